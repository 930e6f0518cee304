"""Offline API: LLM(model=...).generate(prompts, SamplingParams) -> list[RequestOutput].

The engine runs in this process (no engine loop thread, no ZMQ); its deltas go through the same output
processor as the server's (engine/output_processor.py), so stop strings and text are identical.
"""
from __future__ import annotations

import itertools

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.output_processor import RequestProcessor
from engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestDelta,
    RequestOutput,
)
from engine.pooling import embedding_params, embedding_values
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = EngineConfig.model, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker ranks (a no-op with one rank); the LLM is unusable afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one per prompt (None: the base model)."""
        prompts, token_prompts = self._prompts(prompts)
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params.")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests.")
        for ids, p in zip(token_prompts, params):  # the door: refuse the batch before any of it runs
            self.info.check_request(ids, p)
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.add_lora(lora)
        outputs: dict[str, tuple[RequestOutput, RequestProcessor]] = {}
        for prompt, ids, p, lora in zip(prompts, token_prompts, params, loras):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, lora=lora)
            processor = RequestProcessor(rid, ids, p, self.tokenizer)
            out = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids, [
                CompletionOutput(c.index, "", c.token_ids, None, logprobs=c.logprobs) for c in processor.choices],
                finished=False)
            outputs[rid] = (out, processor)
        bar = tqdm(total=len(outputs), disable=not use_tqdm, desc="Generating")
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                self._apply(*outputs[delta.request_id], delta)
            bar.n = sum(out.finished for out, _ in outputs.values())
            bar.refresh()
        bar.close()
        return [out for out, _ in outputs.values()]

    def embed(self, prompts: Prompt | list[Prompt]) -> list[EmbeddingRequestOutput]:
        """Each prompt's (text or token ids) embedding: the model's final hidden states pooled as the
        engine's pooling_type says and L2-normalized, the vectors /v1/embeddings returns. Embedding
        requests are batched and chunked like any prompt; nothing is generated."""
        _, token_prompts = self._prompts(prompts)
        params = embedding_params()
        for ids in token_prompts:   # the door: refuse the batch before any of it runs
            self.info.check_request(ids, params)
        outputs: dict[str, EmbeddingRequestOutput] = {}
        for ids in token_prompts:
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, params)
            outputs[rid] = EmbeddingRequestOutput(rid, ids, EmbeddingOutput([]), finished=False)
        errors = []
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.error is not None:
                    errors.append(f"request {delta.request_id}: {delta.error}")
                elif delta.embedding is not None:
                    out = outputs[delta.request_id]
                    out.outputs.embedding, out.finished = embedding_values(delta.embedding), True
        if errors:
            raise RuntimeError("; ".join(errors))
        return list(outputs.values())

    def _prompts(self, prompts: Prompt | list[Prompt]) -> tuple[list[Prompt], list[list[int]]]:
        """One prompt or a list of them -> the list, and each one's token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return prompts, [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _apply(self, out: RequestOutput, processor: RequestProcessor, delta: RequestDelta) -> None:
        if delta.error is not None and delta.error_status < 500:   # e.g. its grammar took too long to compile
            raise ValueError(f"request {delta.request_id}: {delta.error}")
        out.num_cached_tokens = delta.num_cached_tokens
        processor.process(delta)
        for index in processor.stopped_samples:      # a stop string ended it: the engine stops it too
            self.engine.abort_request(delta.request_id, index, "stop")
        processor.stopped_samples.clear()
        for completion, choice in zip(out.outputs, processor.choices):
            completion.text = choice.text
            completion.finish_reason = "error" if processor.error else choice.finish_reason
            completion.stop_reason = choice.stop_reason
        out.finished = processor.finished
        if processor.prompt_logprobs is not None:
            out.prompt_logprobs = [None, *processor.prompt_logprobs]
