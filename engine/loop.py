"""EngineLoop: the one thread that owns the engine (model state, KV cache).

Other threads talk to it only through a thread-safe inbox (add / abort); after each step it hands
every new token of the step, and the scheduler's stats, to one `deliver` callback.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable

from engine.lora.request import LoRARequest
from engine.messages import LoadLoRA, LoRAControl
from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core import Engine

log = logging.getLogger(__name__)
Deliver = Callable[[list[RequestDelta], EngineStats], None]
_STOP = object()


class EngineLoop:
    def __init__(self, engine: "Engine", deliver: Deliver,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.deliver = deliver
        self.on_death = on_death        # called on this thread after the failed requests were delivered
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        self._thread.start()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora: LoRARequest | None = None) -> None:
        # Checked at the door (ModelInfo.check_request) before it was sent here.
        self.inbox.put(("add", request_id, prompt_token_ids, params, arrival_time, lora))

    def control_lora(self, control: LoRAControl) -> None:
        """Loads or unloads an adapter between steps; the answer is a finished delta for its request id."""
        self.inbox.put(("lora", control))

    def abort(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None:
        self.inbox.put(("abort", request_id, seq_index, finish_reason))

    def reject(self, request_id: str, message: str) -> None:
        """A request that never made it into the engine (its message did not decode): fail it, with 400."""
        self.inbox.put(("reject", request_id, message))

    def kill(self, error: BaseException) -> None:
        """Ends the loop as if its step had raised `error` (e.g. a tensor-parallel rank died while idle)."""
        self.inbox.put(("fail", error))

    def shutdown(self, timeout: float | None = None) -> None:
        self._stopping = True
        self.inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands = self._drain(block=not self.engine.has_unfinished_requests())
                if commands is None:
                    return
                deltas = self._apply(commands)
                stepped = self.engine.has_unfinished_requests()
                if stepped:
                    deltas.extend(self.engine.step())
                if deltas or commands:
                    self.deliver(deltas, self.engine.stats())
                elif stepped:
                    self._report_work()
        except BaseException as e:  # the engine is unusable: fail everyone, let the server report it
            log.exception("engine thread died")
            self.error = e
            self._stopping = True
            try:
                self.deliver(self.engine.fail_all(e), self.engine.stats())
                if self.on_death is not None:
                    self.on_death(e)
            except BaseException:
                log.exception("could not report the engine failure")

    def _report_work(self) -> None:
        """A step with no news for any request (a prompt chunk) still counts as progress for the front
        end's --engine-stall-timeout: it is delivered when it computed something. A step that computed
        nothing (waiting on a grammar) sends nothing, so a stuck engine stays visible; but stats() hands over
        what it drained (grammar compile times) only once, so those are always delivered."""
        stats = self.engine.stats()
        step = stats.step
        if (step is not None and (step.num_prefill_tokens or step.num_decode_seqs)) or stats.grammar_compile_seconds:
            self.deliver([], stats)

    def _drain(self, block: bool) -> list | None:
        commands = []
        try:
            item = self.inbox.get(block=block)
            while True:
                if item is _STOP:
                    return None
                commands.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return commands

    def _control_lora(self, control: LoRAControl) -> RequestDelta:
        error = None
        try:
            if isinstance(control, LoadLoRA):
                self.engine.add_lora(control.lora)
            else:
                self.engine.remove_lora(control.lora_int_id)
        except ValueError as e:    # not a usable adapter, LoRA off, or requests still on it
            error = str(e)
        return RequestDelta(control.request_id, [], True, 0, 0, RequestTimings(0.0), error=error, error_status=400)

    def _apply(self, commands: list) -> list[RequestDelta]:
        failed = []
        for cmd in commands:
            if cmd[0] == "add":
                _, request_id, prompt, params, arrival, lora = cmd
                try:
                    self.engine.add_request(request_id, prompt, params, arrival, lora=lora)
                except ValueError as e:  # e.g. a duplicate id or a broken adapter: tell that request only
                    failed.append(RequestDelta(request_id, [SequenceDelta(0, [], None, "error")], True,
                                               len(prompt), 0, RequestTimings(arrival or 0.0), error=str(e),
                                               error_status=400))
            elif cmd[0] == "lora":
                failed.append(self._control_lora(cmd[1]))
            elif cmd[0] == "reject":
                _, request_id, message = cmd
                failed.append(RequestDelta(request_id, [SequenceDelta(0, [], None, "error")], True, 0, 0,
                                           RequestTimings(0.0), error=message, error_status=400))
            elif cmd[0] == "fail":
                raise cmd[1]
            else:
                _, request_id, seq_index, reason = cmd
                self.engine.abort_request(request_id, seq_index, reason)
        return failed
