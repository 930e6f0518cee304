"""pagedserve's engine: scheduling and model execution (knows nothing about HTTP)."""
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig"]


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
    raise AttributeError(name)
