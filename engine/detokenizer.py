"""Incremental detokenization: UTF-8 safe, stop strings matched across tokens and never leaked.

Each push decodes only a small window of tokens: `prefix` tokens whose text was already emitted (kept
as left context, since tokenizers such as SentencePiece render a token differently at the start of a
text) followed by the unread tokens. The new text is decode(window) minus decode(prefix). While the
window's text ends in U+FFFD a multi-byte character is still incomplete, so nothing is emitted until a
later token completes it. This is the prefix/read-offset technique of vLLM's detokenizer.

Emitted text is then held back once more for stop strings: the longest suffix of the pending text that
could still grow into a stop string waits until the next token decides.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"
# Prompt tokens used as left context for the first output token.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        # The Rust tokenizer behind a fast HF tokenizer decodes the same text without the Python wrapper's
        # overhead (this runs once or twice per token on the server's event loop).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_text = self._decode(self._window)
        if self._prefix_text.endswith(_REPLACEMENT):
            # A prompt given as token ids may end inside a character: the output must not complete it.
            self._window, self._prefix_text = [], ""
        self._read = len(self._window)     # window[:read] is the prefix, window[read:] is unread
        self._pending = ""                 # decoded but held back (a possible start of a stop string)
        self._pieces: list[str] = []
        self._text: str | None = ""
        self._stopped: str | None = None
        self._finished = False

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, once one did."""
        return self._stopped

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._text is None:
            self._text = "".join(self._pieces)
        return self._text

    def push(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the new text that is safe to emit now (may be "")."""
        if self._stopped is not None or self._finished or not new_token_ids:
            return ""
        window = self._window
        window += new_token_ids
        new_text = self._decode(window)
        prefix_len = len(self._prefix_text)
        if len(new_text) <= prefix_len or new_text[-1] == _REPLACEMENT:
            return ""                      # nothing new, or a character is still incomplete
        # Slide: the tokens just read become the prefix (left context) of the next window.
        self._window = window = window[self._read:]
        self._read = len(window)
        self._prefix_text = self._decode(window)
        if not self.stop:                  # nothing to hold back (most requests): emit at once
            return self._emit(new_text[prefix_len:])
        self._pending += new_text[prefix_len:]
        return self._release(final=False)

    def flush(self) -> str:
        """At finish (no stop string matched): release everything held back, incomplete bytes as U+FFFD."""
        if self._stopped is not None or self._finished:
            return ""
        new_text = self._decode(self._window)
        if len(new_text) > len(self._prefix_text):
            self._pending += new_text[len(self._prefix_text):]
        out = self._release(final=True)
        self._finished = True
        return out

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it would make window-by-window text differ from one-shot text.
        if self._backend is not None:
            return self._backend.decode(ids, self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _release(self, final: bool) -> str:
        text = self._pending
        match = _first_stop(text, self.stop)
        if match is not None:
            start, stop = match
            self._stopped, self._pending = stop, ""
            return self._emit(text[:start + len(stop)] if self.include_stop_str_in_output else text[:start])
        hold = 0 if final else _stop_prefix_len(text, self.stop)
        self._pending = text[len(text) - hold:]
        return self._emit(text[:len(text) - hold])

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
            self._text = None
        return piece


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string completed first when reading `text` left to right (ties: the longer one),
    as (start index, stop string). Emitted text never holds part of a match, so only `text`
    (the pending text) needs searching."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[1], best[2])


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        first = stop[0]
        j = text.find(first, max(0, len(text) - len(stop) + 1))
        while j >= 0 and len(text) - j > longest:
            if stop.startswith(text[j:]):
                longest = len(text) - j
                break
            j = text.find(first, j + 1)
    return longest


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text, for logprobs (a token holding part of a character renders as U+FFFD)."""
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)
