"""Offline API: LLM(model=...).generate(prompts, SamplingParams) -> list[RequestOutput]."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine import LLMEngine
from engine.outputs import CompletionOutput, RequestDelta, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class _SampleState:
    output: CompletionOutput
    detok: IncrementalDetokenizer


@dataclass
class _RequestState:
    output: RequestOutput
    samples: dict[int, _SampleState] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(o.finish_reason is not None for o in self.output.outputs)


class LLM:
    def __init__(self, model: str = EngineConfig.model, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params.")
        token_prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(token_prompts, params):  # refuse the batch before any of it runs
            self.engine.check_request(ids, p)
        states: dict[str, _RequestState] = {}
        for prompt, ids, p in zip(prompts, token_prompts, params):
            rid = f"offline-{next(self._ids)}"
            states[rid] = self._add(rid, prompt, ids, p)
        bar = tqdm(total=len(states), disable=not use_tqdm, desc="Generating")
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                self._apply(states[delta.request_id], delta)
            bar.n = sum(s.done for s in states.values())
            bar.refresh()
        bar.close()
        return [s.output for s in states.values()]

    def _add(self, rid: str, prompt: Prompt, ids: list[int], p: SamplingParams) -> _RequestState:
        text = prompt if isinstance(prompt, str) else None
        self.engine.add_request(rid, ids, p)
        state = _RequestState(RequestOutput(rid, text, ids, []))
        for index in range(p.n):
            out = CompletionOutput(index, "", [], None, logprobs=[] if p.logprobs is not None else None)
            detok = IncrementalDetokenizer(self.tokenizer, ids, p.stop, p.include_stop_str_in_output,
                                           p.skip_special_tokens)
            state.output.outputs.append(out)
            state.samples[index] = _SampleState(out, detok)
        return state

    def _apply(self, state: _RequestState, delta: RequestDelta) -> None:
        state.output.num_cached_tokens = delta.num_cached_tokens
        for sd in delta.seqs:
            sample = state.samples[sd.index]
            out = sample.output
            if out.finish_reason is not None:
                continue
            out.token_ids.extend(sd.new_token_ids)
            if out.logprobs is not None and sd.new_logprobs:
                out.logprobs.extend(sd.new_logprobs)
            out.text += sample.detok.push(sd.new_token_ids)
            if sample.detok.stopped is not None:
                out.finish_reason, out.stop_reason = "stop", sample.detok.stopped
                self.engine.abort_request(delta.request_id, sd.index, "stop")
            elif sd.finish_reason is not None:
                out.text += sample.detok.flush()
                out.finish_reason, out.stop_reason = sd.finish_reason, sd.stop_reason
        state.output.finished = state.done
