"""SpeculativeConfig: `--speculative-config JSON` / `LLM(speculative_config=dict)`, in vLLM's shapes.

  {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}
  {"method": "draft_model", "model": PATH, "num_speculative_tokens": K}
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_FLAG = "--speculative-config"
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4      # ngram: longest suffix n-gram looked up in the sequence
    prompt_lookup_min: int = 2      # ngram: shortest
    model: str | None = None        # draft_model: a checkpoint with the target's vocabulary

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON string or a dict -> the config; every mistake is a ValueError naming the flag."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_FLAG} is not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_FLAG} must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"{_FLAG} has unsupported keys {unknown}; known: {sorted(_KEYS)}.")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"{_FLAG}: method must be one of {', '.join(METHODS)}, got {method!r}.")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{_FLAG}: num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}.")
        if method == "ngram":
            return cls._ngram(value, k)
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{_FLAG}: method draft_model needs \"model\": the draft checkpoint's path.")
        extra = {"prompt_lookup_max", "prompt_lookup_min"} & set(value)
        if extra:
            raise ValueError(f"{_FLAG}: {sorted(extra)} apply to method ngram only.")
        return cls("draft_model", k, model=model)

    @classmethod
    def _ngram(cls, value: dict[str, Any], k: int) -> SpeculativeConfig:
        if "model" in value:
            raise ValueError(f"{_FLAG}: \"model\" applies to method draft_model only.")
        hi = value.get("prompt_lookup_max", cls.prompt_lookup_max)
        lo = value.get("prompt_lookup_min", min(cls.prompt_lookup_min, hi) if isinstance(hi, int) else 1)
        for name, n in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
                raise ValueError(f"{_FLAG}: {name} must be an integer in [1, 64], got {n!r}.")
        if lo > hi:
            raise ValueError(f"{_FLAG}: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")
        return cls("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo)
