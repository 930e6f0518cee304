import os

import torch

# Triton decides at decoration time whether to interpret; without a GPU every kernel test runs on the
# CPU interpreter, so the switch must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
