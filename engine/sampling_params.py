"""Per-request sampling parameters (vLLM-shaped) with user-facing validation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured.spec import StructuredOutputs

# Bounds on what one request may make the engine allocate or compute.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Log-probabilities of the prompt's own tokens (each but the first) and the k best alternatives.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None   # json / regex / choice / grammar constraint
    # An embedding request (/v1/embeddings, LLM.embed): the prompt is computed, its final hidden states are
    # pooled (--pooling-type) into RequestDelta.embedding, and nothing is sampled. max_tokens is 0.
    embed: bool = False
    # Filled in by the engine from generation_config.json / the tokenizer, not by users.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def min_max_tokens(self) -> int:
        """0 computes the prompt without generating: to score it (completions' echo with max_tokens 0) or
        to embed it."""
        return 0 if self.prompt_logprobs is not None or self.embed else 1

    def validate(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.embed:
            self._check_embed()
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, self.min_max_tokens, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens}).")
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, 0, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, None)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings.")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"each stop string may be at most {MAX_STOP_STRING_LEN} characters.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids.")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries.")
            for tok, bias in self.logit_bias.items():
                _check_int("logit_bias", tok, 0, None)
                _check_float("logit_bias", bias, -100.0, 100.0)

    def _check_embed(self) -> None:
        if self.max_tokens != 0 or self.n != 1:
            raise ValueError("an embedding request generates nothing: it needs max_tokens=0 and n=1.")
        if self.logprobs is not None or self.prompt_logprobs is not None or self.structured_outputs is not None:
            raise ValueError("an embedding request takes no logprobs, prompt_logprobs or structured_outputs.")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            for tok in ids:
                if tok >= vocab_size:
                    raise ValueError(f"{name} names token id {tok}, outside the vocabulary (size {vocab_size}).")


def _check_int(name: str, value: object, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {value}.")


def _check_float(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if not math.isfinite(value) or value < lo or value > hi:
        raise ValueError(f"{name} must be a finite number in [{lo}, {hi}], got {value}.")
