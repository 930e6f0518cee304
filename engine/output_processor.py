"""The one output processor: engine deltas -> text, stop strings, logprobs and finish reasons per choice.

The HTTP server (server/generation.py) and the offline API (engine/llm.py) both feed it. It runs where
the text is needed, in the front end, never in the engine loop: the engine only knows token ids, and is
told to stop a sample when a stop string (which only the text shows) completes.

A request with n samples is one engine request; its choices are numbered `first_index + sample index`
(the server numbers the choices of a multi-prompt request prompt_index * n + sample index).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestDelta, SequenceDelta, TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class ChoiceDelta:
    """What one choice gained in one update."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Choice:
    """Everything one choice has produced so far."""
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestProcessor:
    """One engine request (one prompt, params.n samples)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 first_index: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._split_for_stop = bool(params.stop)
        self.choices = [
            Choice(first_index + i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                                           params.include_stop_str_in_output,
                                                           params.skip_special_tokens),
                   logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)]
        self._num_unfinished = params.n         # choices without a finish_reason
        self.finished = False
        self.error: str | None = None           # why the engine failed this request, once it did
        self.error_status = 500                 # 400: the request itself was at fault (e.g. its grammar)
        self.last_finish_reason = "stop"        # the outcome is that of the last sample to finish
        self.stopped_samples: list[int] = []    # ended by a stop string: the engine must be told to stop them
        self.prompt_logprobs: list[TokenLogprob] | None = None   # entry p scores prompt token p + 1
        self.embedding: bytes | None = None     # an embedding request's vector (RequestDelta.embedding)

    def process(self, delta: RequestDelta) -> list[ChoiceDelta]:
        """The choices' news in one engine delta. Afterwards `finished`, `error` and `stopped_samples`
        (cleared by the caller once it has told the engine) say what else happened."""
        if self.finished:
            return []       # tokens still in flight after every sample was stopped here
        seqs = delta.seqs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.error is not None or _has_error(seqs):
            self.error = delta.error or "generation failed inside the engine"
            self.error_status = delta.error_status
            self.finished = True
            return []
        out = []
        for seq in seqs:
            choice_delta = self._process_seq(seq, delta.finished)
            if choice_delta is not None:
                out.append(choice_delta)
        if delta.finished or self._num_unfinished == 0:
            if self._num_unfinished:
                self.error = "the engine finished a request with an unfinished sample"
            self.finished = True
        return out

    def _process_seq(self, seq: SequenceDelta, request_done: bool) -> ChoiceDelta | None:
        choice = self.choices[seq.index]
        if choice.finish_reason is not None:
            return None
        text, token_ids = self._push(choice, seq.new_token_ids)
        logprobs = seq.new_logprobs[:len(token_ids)] if seq.new_logprobs is not None else None
        if choice.logprobs is not None and logprobs:
            choice.logprobs.extend(logprobs)
        choice.token_ids += token_ids
        if choice.detok.stopped is not None:
            self._finish(choice, "stop", choice.detok.stopped)
            if seq.finish_reason is None and not request_done:
                self.stopped_samples.append(seq.index)
        elif seq.finish_reason is not None:
            text += choice.detok.flush()
            self._finish(choice, seq.finish_reason, seq.stop_reason)
        choice.text += text
        if not text and not token_ids and choice.finish_reason is None:
            return None
        return ChoiceDelta(choice.index, text, token_ids, logprobs, choice.finish_reason, choice.stop_reason)

    def _finish(self, choice: Choice, reason: str, stop_reason: int | str | None) -> None:
        choice.finish_reason, choice.stop_reason = reason, stop_reason
        self.last_finish_reason = reason
        self._num_unfinished -= 1

    def _push(self, choice: Choice, token_ids: list[int]) -> tuple[str, list[int]]:
        """Feeds the detokenizer; with stop strings, one token at a time, so that tokens after the one
        that completed a stop string are neither returned nor counted."""
        if not self._split_for_stop or len(token_ids) <= 1:
            return choice.detok.push(token_ids), token_ids
        pieces = []
        for i, tok in enumerate(token_ids):
            pieces.append(choice.detok.push([tok]))
            if choice.detok.stopped is not None:
                return "".join(pieces), token_ids[:i + 1]
        return "".join(pieces), token_ids

    def expire(self) -> list[ChoiceDelta]:
        """Finishes every unfinished choice with "abort"; text held back for a possible stop string is
        released, as at any finish. The caller tells the engine to stop the request."""
        out = []
        for choice in self.choices:
            if choice.finish_reason is None:
                text = choice.detok.flush()
                choice.text += text
                choice.finish_reason = "abort"
                self._num_unfinished -= 1
                out.append(ChoiceDelta(choice.index, text, [], None, "abort"))
        self.finished = True
        return out


def _has_error(seqs: list[SequenceDelta]) -> bool:
    for seq in seqs:        # a loop, not any(<genexpr>): this runs once per token
        if seq.finish_reason == "error":
            return True
    return False
