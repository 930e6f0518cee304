"""Log-probabilities in the two OpenAI formats (completions' legacy lists, chat's per-token objects).

A token is shown by its own bytes: as text when they are valid UTF-8, else as OpenAI's "bytes:\\xe2\\x80"
form. Rendering a partial character as U+FFFD instead would make distinct alternatives collide in
completions' {token: logprob} maps, and lose what chat's `bytes` field exists to carry.
"""
from __future__ import annotations

import codecs
import re
from typing import Any

from tokenizers import decoders

from engine.outputs import TokenLogprob

# OpenAI's floor for "very unlikely"; also keeps -inf / NaN out of the JSON.
LOGPROB_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def clamp(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR   # NaN compares False -> floor


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE spells every byte as one printable character: printable Latin-1 bytes as themselves,
    the other bytes as the characters from U+0100 on, in byte order. Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """Each token id's (display string, bytes), cached per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = isinstance(decoder, decoders.ByteLevel)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[str, bytes]] = {}

    def pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        missing = [i for i in dict.fromkeys(ids) if i not in self._cache]
        if missing:
            for i, token in zip(missing, self.tokenizer.convert_ids_to_tokens(missing)):
                self._cache[i] = self._render(token or "")
        return [self._cache[i] for i in ids]

    def _render(self, token: str) -> tuple[str, bytes]:
        if self._byte_level and all(c in _BYTE_LEVEL for c in token):
            raw = bytes(_BYTE_LEVEL[c] for c in token)
        elif match := _BYTE_FALLBACK.fullmatch(token):
            raw = bytes([int(match.group(1), 16)])
        else:
            raw = token.replace("\u2581", " ").encode("utf-8")    # SentencePiece's word-start mark
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class OffsetCounter:
    """Character offset of each token in a choice's text, from the tokens' bytes: a character split across
    tokens counts once it is complete, and skipped special tokens count nothing."""

    def __init__(self, skip_special: bool) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip_special = skip_special
        self.chars = 0

    def advance(self, ids: list[int], pieces: list[tuple[str, bytes]], special: frozenset[int]) -> list[int]:
        offsets = []
        for tok, (_, raw) in zip(ids, pieces):
            if self._skip_special and tok in special:
                offsets.append(self.chars)
                continue
            if self._decoder.getstate()[0] and raw and not 0x80 <= raw[0] <= 0xBF:
                # The unfinished character before this token will never complete: it is one U+FFFD.
                self._decoder.reset()
                self.chars += 1
            offsets.append(self.chars)
            self.chars += len(self._decoder.decode(raw))
        return offsets


def _alternatives(text: TokenText, logprobs: list[TokenLogprob], k: int) -> list[list[tuple[str, bytes, float]]]:
    """The k best alternatives at each position; one tokenizer call for all of them."""
    ids = [tok for lp in logprobs for tok, _ in lp.top[:k]]
    pieces = iter(text.pieces(ids))
    return [[(*next(pieces), clamp(value)) for _, value in lp.top[:k]] for lp in logprobs]


def completion_logprobs(text: TokenText, offsets: OffsetCounter, token_ids: list[int],
                        logprobs: list[TokenLogprob], k: int, num_unscored: int = 0) -> dict[str, Any]:
    """Completions format. The first `num_unscored` tokens are listed with null logprobs (an echoed prompt's
    first token: nothing comes before it to score it)."""
    pieces = text.pieces(token_ids)
    token_logprobs: list[float | None] = [None] * num_unscored
    top_logprobs: list[dict[str, float] | None] = [None] * num_unscored
    for (string, _), lp, top in zip(pieces[num_unscored:], logprobs, _alternatives(text, logprobs, k)):
        chosen = clamp(lp.logprob)
        token_logprobs.append(chosen)
        entry = {s: v for s, _, v in top}
        entry.setdefault(string, chosen)    # the sampled token is listed even when not among the top k
        top_logprobs.append(entry)
    return {"tokens": [s for s, _ in pieces], "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets.advance(token_ids, pieces, text.special_ids)}


def chat_logprobs(text: TokenText, token_ids: list[int], logprobs: list[TokenLogprob], k: int) -> dict[str, Any]:
    content = [
        {"token": string, "logprob": clamp(lp.logprob), "bytes": list(raw),
         "top_logprobs": [{"token": s, "logprob": v, "bytes": list(b)} for s, b, v in top]}
        for (string, raw), lp, top in zip(text.pieces(token_ids), logprobs, _alternatives(text, logprobs, k))]
    return {"content": content, "refusal": None}


def prompt_logprobs_list(text: TokenText, logprobs: list[TokenLogprob], k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the token itself and its k best alternatives."""
    out: list[dict[str, Any] | None] = [None]
    alternatives = _alternatives(text, logprobs, k)
    for (string, _), lp, top in zip(text.pieces([lp.token_id for lp in logprobs]), logprobs, alternatives):
        entry = {str(tok): {"logprob": value, "rank": rank, "decoded_token": s}
                 for rank, ((tok, _), (s, _, value)) in enumerate(zip(lp.top, top), start=1)}
        entry[str(lp.token_id)] = {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": string}
        out.append(entry)
    return out
