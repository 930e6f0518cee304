"""pagedserve's engine: scheduling and model execution (knows nothing about HTTP)."""
import os

# OpenMP threads that finish a parallel region first sleep instead of spinning (read once, when torch loads
# its OpenMP runtime, so it is set before any torch import of ours). On a machine whose cores are shared,
# spinning threads hold the cores the last thread of the region needs: a 2-thread forward on 2 busy cores
# ran 10-70x slower with the default policy, and about as fast as with an idle machine with PASSIVE
# (docs/benchmarks.md). An OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "LoRARequest"]


def __getattr__(name: str):
    # Lazy, so that `import engine.sampling_params` stays light (no model code, no transformers).
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    if name == "LoRARequest":
        from engine.lora.request import LoRARequest
        return LoRARequest
    raise AttributeError(name)
