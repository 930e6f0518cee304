"""The whole engine with attention_backend='triton' (CPU interpreter) gives the torch backend's greedy tokens."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import make_checkpoint, random_prompts
from tests.kernels.paged_cases import DEVICE


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def checkpoint(request, tmp_path_factory):
    # the test default shape: 2 layers, hidden 64, 4 query / 2 KV heads of 16 dims. The triton backend also
    # swaps in the fused norm / RoPE (Qwen3: q/k-norm + RoPE; Llama: llama3-scaled RoPE) / SiLU kernels.
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def _greedy_tokens(path, backend: str, prompts: list[list[int]]) -> list[list[int]]:
    # block_size 4 and a 16-token budget: prompts span pages and get chunked, so steps mix prefill chunks
    # over a cached prefix with decode rows; the shared prefix of the last two prompts hits the prefix cache.
    llm = LLM(model=str(path), device=DEVICE, dtype="float32", attention_backend=backend, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.engine.runner.backend.name == backend
    assert (llm.engine.model.norm.fused is not None) == (backend == "triton")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def test_triton_engine_matches_torch_engine(checkpoint):
    short, long, shared = random_prompts(1000, [3, 21, 12], seed=5)
    prompts = [short, long, shared + [7, 8, 9], shared + [10, 11]]
    torch_tokens = _greedy_tokens(checkpoint, "torch", prompts)
    triton_tokens = _greedy_tokens(checkpoint, "triton", prompts)
    assert triton_tokens == torch_tokens
    assert len({tuple(t) for t in torch_tokens}) > 1  # the prompts matter, so a broken kernel would show
