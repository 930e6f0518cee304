"""The tokenizer's work on request inputs, kept off the event loop.

Tokenizing a 10 MB prompt takes seconds; on the event loop that would stall /health and every stream for as
long. So:
- a prompt longer in characters than any tokenization could fit into max_model_len is refused before it is
  tokenized (400, naming the field), when the tokenizer's shape makes that bound sound (`prompt_char_limit`);
- inputs of more than INLINE_SIZE characters (or token ids) are tokenized, rendered (chat templates) and decoded in one
  worker thread (the tokenizers library releases the GIL while it encodes), while the loop goes on. Smaller
  ones stay inline: a thread hop would cost more than the work.
The worker and the loop share one tokenizer: both only read it (nothing here sets truncation or padding,
the tokenizer's only mutable state), which the tokenizers library allows from several threads.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from server.errors import APIError

T = TypeVar("T")

INLINE_SIZE = 2048           # characters or token ids: about a millisecond of work, done on the loop
# Normalizers that never drop characters; Unicode composition (NFC, NFKC) merges at most 4 code points
# into one (a Greek vowel with three diacritics), the only way they shorten a text.
_KEEPING_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a text can have and still tokenize to max_model_len tokens or fewer; None when
    the tokenizer may drop or fuse characters, so that no such bound holds (its prompts are all tokenized).

    A BPE tokenizer that keeps every character (byte-level, or no unknown token that fuses runs of
    characters) spells each token with at most its vocabulary string's length in characters, so a text of
    C characters needs at least C / longest tokens (times what a composing normalizer can merge).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre_types = _pre_tokenizer_types(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if shrink is None or pre_types is None or model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    return max_model_len * max(longest, 1) * shrink if longest else None


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    if spec.get("type") == "Sequence":
        factors = [_normalizer_shrink(s) for s in spec.get("normalizers", [])]
        if any(f is None for f in factors):
            return None
        product = 1
        for f in factors:
            product *= f
        return product
    return _KEEPING_NORMALIZERS.get(spec.get("type"))


def _pre_tokenizer_types(spec: dict | None) -> set[str] | None:
    """The pre-tokenizers' types when none of them removes characters, else None."""
    if spec is None:
        return set()
    if spec.get("type") == "Sequence":
        types: set[str] = set()
        for s in spec.get("pretokenizers", []):
            inner = _pre_tokenizer_types(s)
            if inner is None:
                return None
            types |= inner
        return types
    kind = spec.get("type")
    if kind not in _KEEPING_PRE_TOKENIZERS or str(spec.get("behavior", "")).lower() == "removed":
        return None
    return {kind}


class TextWork:
    """Runs tokenizer work inline when it is small, else in the one worker thread."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_chars = prompt_char_limit(tokenizer, max_model_len)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")

    def check_prompt_chars(self, text: str, param: str) -> None:
        """400 before tokenizing for a text that no tokenization could fit into the context."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and a "
                                f"{param} of {len(text)} characters cannot fit in it (at most "
                                f"{self.max_prompt_chars} characters could). Please shorten the {param}.",
                           param=param)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), inline when `size` (characters or tokens) is small, else in the worker thread."""
        if size <= INLINE_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
