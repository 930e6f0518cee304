"""LLMEngine: add_request / abort_request / step over the scheduler, model runner and sampler."""
from __future__ import annotations

import copy
import itertools
import logging
import time

import torch

from engine import device_info
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.distributed.workers import WorkerGroup
from engine.executor import PLACEHOLDER, LaunchedStep, StepExecutor, StepResult, StepTask
from engine.lora.manager import LoRAManager, startup_adapters
from engine.lora.request import LoRARequest
from engine.model_info import ModelInfo, TokenizerSource
from engine.outputs import EngineStats, RequestDelta, SequenceDelta, StepStats, StepTiming, TokenLogprob, add_token
from engine.pooling import PoolChunk, add_chunk, encode_vectors, plan_pooling
from engine.request import Request, SeqStatus, Sequence, collect_prompt_logprobs
from engine.runner_setup import build_runner, plan_model
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.spec_decode.speculator import Speculator
from engine.step_rows import finish_reason, sampling_rows
from engine.structured.manager import StructuredOutputManager

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.plan = plan = plan_model(config)
        self.config = cfg = plan.config
        self.device = torch.device(cfg.device)
        torch.manual_seed(cfg.seed)
        model_dir, self.model_name = plan.model_dir, plan.model_name
        self.max_model_len = plan.max_model_len
        self.workers: WorkerGroup | None = None
        if cfg.tensor_parallel_size > 1:     # ranks 1.. start first: joining the group waits for all of them
            self.workers = WorkerGroup.start(plan)
        try:
            built = build_runner(plan, self.device)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(graceful=False)
            raise
        loaded, self.num_kv_blocks, self.runner = built.loaded, built.num_kv_blocks, built.runner
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.default_sampling = loaded.generation_defaults
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = plan.model_config.vocab_size
        self.lora: LoRAManager | None = built.lora
        startup_loras = startup_adapters(cfg)       # --lora-modules: a broken adapter stops the startup
        if self.lora is not None:
            self.lora.start(startup_loras, self.workers.channel.send_lora if self.workers is not None else None)
        spec = cfg.speculative_config
        self.info = ModelInfo(
            self.model_name, self.max_model_len, self.vocab_size, tuple(self.eos_token_ids), self.num_kv_blocks,
            cfg.block_size, cfg.max_num_seqs, TokenizerSource.of(model_dir), dict(self.default_sampling),
            cfg.device, cfg.dtype, cfg.attention_backend,
            cuda_graphs=self.runner.graphs is not None and self.runner.graphs.use_graphs,
            device_name=device_info.device_name(self.device),
            weight_bytes=device_info.weight_bytes_per_step(self.model),
            kv_bytes_per_token=device_info.kv_bytes_per_token(self.model, cfg.torch_dtype),
            memory_bandwidth=device_info.memory_bandwidth(self.device), max_logprobs=cfg.max_logprobs,
            model_weight_bytes=built.model_weight_bytes, weight_format=built.weight_format,
            max_loras=cfg.max_loras if cfg.enable_lora else 0, lora_modules=startup_loras,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            speculative_method="" if spec is None else spec.method)
        self.block_manager = BlockManager(self.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, cfg.max_loras if cfg.enable_lora else 0)

        self.sampler = Sampler(self.vocab_size, self.device, cfg.seed)
        self.spec = None if spec is None else Speculator(spec, plan, self.num_kv_blocks, self.vocab_size,
                                                         self.tokenizer.get_vocab(), self.device)
        draft = None if self.spec is None else self.spec.draft
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  cfg.grammar_compile_timeout)
        self.overlap = cfg.async_scheduling
        self.executor = StepExecutor(self.runner, self.sampler, self.overlap, sync_cuda=False,
                                     channel=self.workers.channel if self.workers is not None else None,
                                     mirror=None if draft is None else draft.mirror)
        self.in_flight: LaunchedStep | None = None
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._record_timings = False
        self.step_timings: list[StepTiming] = []
        self._last_step: StepStats | None = None     # for the next stats(): the dashboard's per-step view
        log.info("engine ready: model=%s device=%s dtype=%s backend=%s kv_blocks=%d (%d tokens) max_model_len=%d",
                 cfg.model, cfg.device, cfg.dtype, cfg.attention_backend, self.num_kv_blocks,
                 (self.num_kv_blocks - 1) * cfg.block_size, self.max_model_len)

    @property
    def record_timings(self) -> bool:
        return self._record_timings

    @record_timings.setter
    def record_timings(self, on: bool) -> None:
        """Per-phase step timings; on CUDA the forward is synchronised so its time is its own."""
        self._record_timings = on
        self.executor.sync_cuda = on and self.device.type == "cuda"

    def dead_worker(self) -> str | None:
        """Why a tensor-parallel worker rank is gone (None: all alive, or no workers)."""
        return None if self.workers is None else self.workers.dead()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker ranks and leaves the process group (no-op on one rank)."""
        if self.workers is not None:
            workers, self.workers = self.workers, None
            workers.shutdown()

    # requests -----------------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that can never run (ModelInfo.check_request: the door's check)."""
        self.info.check_request(prompt_token_ids, params)

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads an adapter on the host (ValueError when its directory is not a usable PEFT adapter)."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} was asked for but LoRA is off: start with --enable-lora.")
        self.lora.add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forgets an adapter; its requests still running finish first (ValueError otherwise)."""
        if self.lora is not None:
            self.lora.remove_unused(lora_int_id, self.requests.values())

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora: LoRARequest | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        if lora is not None:
            self.add_lora(lora)
        # Validated at the door (ModelInfo.check_request, in the front end or LLM.generate), not again here.
        params = copy.copy(params)
        params.eos_token_ids = list(self.eos_token_ids)
        n = len(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        req = Request(request_id, list(prompt_token_ids), params, max_tokens,
                      pooling=self.config.pooling_type if params.embed else None, lora=lora)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = []
        if arrival_time is not None:
            req.timings.arrival_time = arrival_time
        seq = self._new_seq(req, 0, list(prompt_token_ids))
        seq.needs_fork = params.n > 1
        self.requests[request_id] = req
        self.structured.add(req)
        self.scheduler.add(seq)

    def _new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        gen = None if req.params.seed is None else self.sampler.make_generator(req.params.seed, index)
        seq = Sequence(next(self._seq_ids), req, index, token_ids, len(req.prompt_token_ids), gen)
        if req.params.logprobs is not None:
            seq.logprobs = []
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if any(s.needs_fork for s in req.seqs):  # its samples do not exist yet: only the whole request can go
            seq_index = None
        for seq in req.seqs:
            if seq_index is None or seq.index == seq_index:
                self.scheduler.finish(seq, finish_reason)
        if seq_index is None or req.finished:
            del self.requests[request_id]
            self.structured.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.in_flight is not None

    def stats(self) -> EngineStats:
        running = {id(s.request) for s in self.scheduler.running}
        waiting = {id(s.request) for s in self.scheduler.waiting} - running
        bm = self.block_manager
        step, self._last_step = self._last_step, None
        running_loras, waiting_loras = ([], []) if self.lora is None else \
            self.lora.in_use(self.scheduler.running, self.scheduler.waiting)
        stats = EngineStats(len(running), len(waiting), bm.usage(), self.scheduler.num_preemptions,
                            bm.prefix_queries, bm.prefix_hits, self.structured.drain_compile_seconds(),
                            bm.num_used_blocks, bm.num_cached_free, step, running_loras, waiting_loras)
        if self.spec is not None:
            c = self.spec.counters
            stats.spec_num_drafts_total, stats.spec_num_draft_tokens_total = c.num_drafts, c.num_draft_tokens
            stats.spec_num_accepted_tokens_total = c.num_accepted_tokens
            stats.spec_accepted_per_pos_total = list(c.accepted_per_pos)
        return stats

    # the step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule and launch the next batch; return the news of the batch that completed.

        Without overlap the launched batch completes within this call. With overlap the previous batch
        is resolved only after the next one is launched, so the device never waits for the host.
        """
        if self.workers is not None:
            self.workers.check()    # a dead rank ends the engine: its collectives can never complete
        deltas: list[RequestDelta] = []
        for req, error in self.structured.poll():   # grammars that failed to compile fail their request
            deltas += self._fail([req], ValueError(error), status=400)
        if self.in_flight is not None and self._needs_host_tokens():
            deltas += self._settle()  # penalties read the real tokens on the host
        t0 = time.perf_counter()
        if self.spec is not None:      # drafts need the real tokens: speculation runs without overlap
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        preempted, self.scheduler.preempted = self.scheduler.preempted, []
        if self.lora is not None and sched.scheduled:   # a slot is rewritten only after the step in flight
            self.lora.activate_running(self.scheduler.running, lambda: deltas.extend(self._settle()))
        launched = None
        if sched.scheduled:
            try:
                launched = self._launch(sched, t0)
            except Exception as e:  # a failed step fails its batch; the engine goes on
                log.exception("engine step failed")
                deltas += self._fail({id(i.seq.request): i.seq.request for i in sched.scheduled}.values(), e)
        deltas += self._settle()
        self.in_flight = launched
        if launched is not None and not self.overlap:
            deltas += self._settle()
        step = launched.step if launched is not None else StepStats(0.0, 0, 0, 0)
        step.seconds, step.preempted = time.perf_counter() - t0, preempted
        self._last_step = step
        return deltas

    def _settle(self) -> list[RequestDelta]:
        """Resolves the step in flight, if any: its news."""
        if self.in_flight is None:
            return []
        deltas = self._resolve(self.in_flight)
        self.in_flight = None
        return deltas

    def _needs_host_tokens(self) -> bool:
        # Penalties read the real tokens on the host, and a grammar's next bitmask needs its last token.
        return any(s.params.uses_penalties or s.matcher is not None for s in self.scheduler.running)

    def _launch(self, sched: SchedulerOutput, t0: float) -> LaunchedStep:
        t1 = time.perf_counter()
        if self.spec is not None:       # the draft model's tokens, where the scheduler made room for them
            self.spec.fill(sched.scheduled)
        now = time.monotonic()
        for item in sched.scheduled:
            if item.seq.request.timings.first_scheduled_time is None:
                item.seq.request.timings.first_scheduled_time = now
        pool = plan_pooling(sched.scheduled)      # embedding requests' chunks (before counting them computed)
        lora_slots = None if self.lora is None else self.lora.slot_array([i.seq.request.lora_id for i in sched.scheduled])
        inputs = self.runner.build_inputs(sched, pool, lora_slots)  # placeholders are filled on the device (overlap)
        sampling: list[ScheduledSeq] = []
        scored: list[tuple[Sequence, range]] = []     # prompt_logprobs, in the runner's row order
        scored_only: list[Sequence] = []              # max_tokens 0: the prompt is done, nothing to sample
        step = StepStats(0.0, 0, 0, 0)
        for item in sched.scheduled:
            seq = item.seq
            if seq.request.prompt_logprobs is not None:
                scored.append((seq, seq.prompt_logprob_positions(item.num_new_tokens)))
            seq.num_computed_tokens += item.num_new_tokens
            step.num_context_tokens += seq.num_computed_tokens
            if (item.num_new_tokens - item.num_spec_tokens == 1
                    and seq.num_computed_tokens - item.num_spec_tokens > seq.num_prompt_tokens):
                step.num_decode_seqs += 1
            else:   # a prompt chunk, or tokens recomputed after a preemption
                step.num_prefill_tokens += item.num_new_tokens
                step.prefill_chunks.append((seq.request.request_id, item.num_new_tokens))
            if item.samples:
                sampling.append(item)
            elif seq.num_computed_tokens == seq.num_tokens and seq.request.pooling is None:
                scored_only.append(seq)     # max_tokens 0: its prompt is complete (embeddings: engine/pooling.py)
        rows, counts, sample_rows, drafts = sampling_rows(sampling, self._fork)
        st = self.sampler.prepare(sample_rows) if rows else None
        if st is not None:
            st.grammar = self.structured.bitmask(rows, self.device)
            if self.spec is not None:
                self.spec.attach(st, rows, drafts)
        positions = []
        for i, seq in enumerate(rows):
            seq.token_ids.append(PLACEHOLDER)
            seq.pending_row = i
            positions.append(len(seq.token_ids) - 1)
        scored = [(seq, span) for seq, span in scored if span]
        task = StepTask(
            inputs, sched.block_copies, self.in_flight.future if inputs.fill_dst is not None else None,
            torch.tensor(counts, device=self.device) if len(counts) != len(rows) else None, st,
            max(seq.params.prompt_logprobs for seq, _ in scored) if scored else None)
        prepare_s = time.perf_counter() - t1
        launched = LaunchedStep(sched, rows, positions, scored, self.executor.submit(task))
        launched.schedule_s, launched.prepare_s, launched.step = t1 - t0, prepare_s, step
        launched.scored_only, launched.pool = scored_only, pool
        launched.spec = [(i.seq, i.num_spec_tokens) for i in sampling if i.num_spec_tokens]
        return launched

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The request's other samples, each sampled from the prompt's logits of this step; the scheduler
        runs them as sequences of their own (scheduler.fork)."""
        children = []
        for index in range(1, parent.params.n):
            child = self._new_seq(parent.request, index, list(parent.token_ids))
            child.matcher = parent.matcher.fork() if parent.matcher is not None else None
            children.append(child)
        self.scheduler.fork(parent, children)
        return children

    def _resolve(self, launched: LaunchedStep) -> list[RequestDelta]:
        t0 = time.perf_counter()
        try:
            result: StepResult = launched.future.result()
        except Exception as e:
            log.exception("engine step failed")
            live = {id(i.seq.request): i.seq.request for i in launched.sched.scheduled
                    if i.seq.request.request_id in self.requests}
            return self._fail(live.values(), e)
        t1 = time.perf_counter()
        deltas = self._postprocess(launched, result)
        for item in launched.sched.scheduled:  # every computed token is real now: publish full blocks
            if item.seq.status is not SeqStatus.FINISHED:
                self.block_manager.register_full_blocks(item.seq)
        if self.record_timings:
            sched = launched.sched
            self.step_timings.append(StepTiming(
                len(sched.scheduled), sched.num_tokens, launched.schedule_s, launched.prepare_s,
                result.forward_s, result.sample_s, time.perf_counter() - t1, wait=t1 - t0))
        return deltas

    def _postprocess(self, launched: LaunchedStep, result: StepResult) -> list[RequestDelta]:
        now = time.monotonic()
        deltas: dict[str, RequestDelta] = {}
        if result.prompt_logprobs is not None:
            collect_prompt_logprobs(launched.scored, result.prompt_logprobs)
        rejected = [] if self.spec is None else self.spec.settle(launched.rows, result.tokens, launched.spec)
        for i, (seq, pos) in enumerate(zip(launched.rows, launched.positions)):
            tok = result.tokens[i]
            # finished or aborted while this step ran, or past a rejected draft
            if seq.status is SeqStatus.FINISHED or tok < 0:
                continue
            req = seq.request
            seq.token_ids[pos] = tok
            entry = None
            if seq.logprobs is not None and result.logprobs is not None:
                lp, ranks, top_ids, top_lps = result.logprobs
                k = seq.params.logprobs
                entry = TokenLogprob(tok, lp[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k])))
                seq.logprobs.append(entry)
            if not self.structured.accept(seq, tok):
                self.scheduler.finish(seq, "stop")
            else:
                self._check_finish(seq, tok, pos)
            if req.timings.first_token_time is None:
                req.timings.first_token_time = now
            add_token(self._delta(deltas, req), seq.index, tok, entry, seq.finish_reason, seq.stop_reason)
        for seq, num_rejected in rejected:
            if seq.status is not SeqStatus.FINISHED:
                del seq.token_ids[len(seq.token_ids) - num_rejected:]    # the placeholders of rejected rows
                self.scheduler.reject_drafts(seq, num_rejected)
        for seq in launched.scored_only:
            if seq.status is not SeqStatus.FINISHED:
                self._finish_scoring(seq, deltas, now)
        if launched.pool:
            self._finish_embeddings(launched.pool, result.pooled, deltas, now)
        for delta in deltas.values():
            req = self.requests[delta.request_id]
            if req.finished:
                delta.finished = True
                req.timings.finished_time = now
                del self.requests[delta.request_id]
        return list(deltas.values())

    @staticmethod
    def _delta(deltas: dict[str, RequestDelta], req: Request) -> RequestDelta:
        """The request's delta of this step; its prompt logprobs ride on the first one after all are in."""
        delta = deltas.get(req.request_id)
        if delta is None:
            delta = deltas[req.request_id] = RequestDelta(
                req.request_id, [], False, len(req.prompt_token_ids), req.num_cached_tokens, req.timings)
            scored = req.prompt_logprobs
            if (scored is not None and not req.prompt_logprobs_sent
                    and len(scored) >= len(req.prompt_token_ids) - 1):
                delta.prompt_logprobs, req.prompt_logprobs_sent = scored, True
        return delta

    def _finish_scoring(self, seq: Sequence, deltas: dict[str, RequestDelta], now: float) -> None:
        """max_tokens 0: the prompt is computed (and scored), so each sample ends without a token."""
        family = [seq, *self._fork(seq)] if seq.needs_fork else [seq]
        delta = self._delta(deltas, seq.request)
        for s in family:
            self.scheduler.finish(s, "length")
            delta.seqs.append(SequenceDelta(s.index, [], None, "length"))
        if seq.request.timings.first_token_time is None:
            seq.request.timings.first_token_time = now

    def _finish_embeddings(self, chunks: list[PoolChunk], pooled: torch.Tensor, deltas: dict[str, RequestDelta],
                           now: float) -> None:
        """Adds each pooled chunk to its embedding request; a request whose prompt is complete finishes
        ("stop", its blocks freed) with its vector in its delta (engine/pooling.py)."""
        done: list[tuple[Sequence, torch.Tensor]] = []
        for chunk, row in zip(chunks, pooled):
            if chunk.seq.status is not SeqStatus.FINISHED:   # else aborted while the step ran
                vector = add_chunk(chunk, row)
                if vector is not None:
                    done.append((chunk.seq, vector))
        if not done:
            return
        for (seq, _), data in zip(done, encode_vectors([vector for _, vector in done])):
            self.block_manager.register_full_blocks(seq)     # its prompt's KV may serve a later request
            self.scheduler.finish(seq, "stop")
            delta = self._delta(deltas, seq.request)
            delta.embedding = data
            delta.seqs.append(SequenceDelta(seq.index, [], None, "stop"))
            if seq.request.timings.first_token_time is None:
                seq.request.timings.first_token_time = now

    def _check_finish(self, seq: Sequence, tok: int, pos: int) -> None:
        """pos: where tok sits in the sequence (later placeholders may follow it under overlap)."""
        reason, stop_reason = finish_reason(seq, tok, pos, self.max_model_len, self.structured.is_complete(seq))
        if reason is not None:
            del seq.token_ids[pos + 1:]
            self.scheduler.finish(seq, reason, stop_reason)

    def _fail(self, requests, error: Exception, status: int = 500) -> list[RequestDelta]:
        """Finish every sequence of the given requests with finish_reason "error" (status 400: the
        request's own fault, and the error says why)."""
        deltas = []
        for req in list(requests):
            for seq in req.seqs:
                self.scheduler.finish(seq, "error")
            req.timings.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self.structured.discard(req.request_id)
            deltas.append(RequestDelta(req.request_id, [SequenceDelta(s.index, [], None, "error") for s in req.seqs],
                                       True, len(req.prompt_token_ids), req.num_cached_tokens, req.timings,
                                       error=str(error) if status < 500 else
                                       f"internal error during generation: {type(error).__name__}",
                                       error_status=status))
        return deltas

    def fail_all(self, error: BaseException) -> list[RequestDelta]:
        return self._fail(self.requests.values(), error)


from engine.loop import EngineLoop  # noqa: E402,F401  (the engine's thread lives beside it)

