"""The engine process: the engine loop thread, scheduler, KV cache and model, behind two ZMQ sockets.

`run_engine_process` is the child process's entry point (started by server/engine_process.py with the
spawn method). It builds the engine, sends EngineReady(ModelInfo) or EngineFailed(error), then:
  - the engine loop thread runs steps and sends one StepOutput per step (engine/loop.py's `deliver`);
  - this process's main thread reads AddRequest / AbortRequest / ArmFault / Shutdown and hands them to the
    loop's inbox, and watches the front end: when it is gone (killed, or exited without a Shutdown) the
    engine exits too, so no orphan keeps holding the GPU.
SIGINT and SIGTERM are ignored here: a Ctrl-C or a process-group SIGTERM is the front end's to handle (it
drains, then sends Shutdown), and a front end that dies takes the engine with it within a second.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from engine import faults
from engine.config import EngineConfig
from engine.loop import EngineLoop
from engine.lora.request import LoRARequest
from engine.messages import (
    AbortRequest,
    AddRequest,
    ArmFault,
    EngineFailed,
    EngineReady,
    LoadLoRA,
    Shutdown,
    StepOutput,
    UnloadLoRA,
    input_codec,
    output_codec,
)
from engine.model_info import ModelInfo
from engine.outputs import EngineStats, RequestDelta

logger = logging.getLogger("pagedserve.engine")
_POLL_MS = 100              # how often the main thread looks at the front end and the loop
_LINGER_MS = 2000           # a last message (EngineFailed) may take this long to leave at exit
EXIT_ENGINE_FAILED = 1


class Engine(Protocol):
    """What the engine loop and this process need of an engine (LLMEngine, or a benchmark's stand-in)."""
    info: ModelInfo

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, arrival_time=None,
                    lora: LoRARequest | None = None) -> None: ...
    def add_lora(self, lora: LoRARequest) -> None: ...
    def remove_lora(self, lora_int_id: int) -> None: ...
    def abort_request(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestDelta]: ...
    def stats(self) -> EngineStats: ...
    def fail_all(self, error: BaseException) -> list[RequestDelta]: ...


EngineFactory = Callable[[EngineConfig], Engine]


def describe(exc: BaseException) -> str:
    """An engine start failure as an operator reads it: a user's mistake by its message alone."""
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _build_engine(config: EngineConfig) -> Engine:
    from engine.engine import LLMEngine
    return LLMEngine(config)


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                       log_level: str = "info", engine_factory: EngineFactory | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, _LINGER_MS)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(input_addr)
    encoder, _ = output_codec()
    try:
        engine = (engine_factory or _build_engine)(config)
    except Exception as exc:
        if not isinstance(exc, (ValueError, FileNotFoundError, OSError)):
            logger.exception("the engine failed to start")
        out.send(encoder.encode(EngineFailed(describe(exc))))
        ctx.destroy(linger=_LINGER_MS)
        sys.exit(EXIT_ENGINE_FAILED)
    injector = faults.FaultInjector(engine) if faults.enabled() else None

    def deliver(deltas: list[RequestDelta], stats: EngineStats) -> None:   # on the loop thread
        # By copy: tens of KB copy faster than a zero-copy send's hand-back through pyzmq's gc thread.
        out.send(encoder.encode(StepOutput(deltas, stats)))

    def on_death(error: BaseException) -> None:   # on the loop thread, right after the failed requests
        out.send(encoder.encode(EngineFailed(f"the engine loop died: {describe(error)}")))

    loop = EngineLoop(engine, deliver, on_death)
    out.send(encoder.encode(EngineReady(engine.info)))
    loop.start()
    code = _serve_inputs(inp, loop, injector, parent_pid, engine)
    loop.shutdown(timeout=5.0)
    if hasattr(engine, "shutdown"):   # tensor-parallel worker ranks
        engine.shutdown()
    # After a Shutdown (or without a front end) nobody reads the step outputs still queued: do not wait on
    # them. After the loop's death, give its EngineFailed a moment to leave.
    ctx.destroy(linger=_LINGER_MS if code != 0 and os.getppid() == parent_pid else 0)
    sys.exit(code)


def _reject(loop: EngineLoop, raw: zmq.Frame, exc: Exception) -> None:
    """A message the front end accepted but this process cannot decode. It happens: e.g. a subnormal top_p
    that a library loaded here (fast-math code flushing denormals) reads back as 0.0. Fail that request."""
    fields = msgspec.msgpack.decode(raw)
    logger.error("engine process: refusing a message that does not decode here: %s", exc)
    if isinstance(fields, list) and len(fields) > 1 and fields[0] == "AddRequest":
        loop.reject(str(fields[1]), f"The engine cannot accept these sampling parameters: {exc}.")


def _serve_inputs(inp: zmq.Socket, loop: EngineLoop, injector: faults.FaultInjector | None, parent_pid: int,
                  engine: Engine) -> int:
    """Feeds the loop until Shutdown (0), the loop's death (1) or the front end's disappearance (0)."""
    _, decoder = input_codec()
    while True:
        if inp.poll(_POLL_MS):
            while True:
                try:
                    raw = inp.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    msg = decoder.decode(raw)
                except msgspec.ValidationError as exc:
                    _reject(loop, raw, exc)      # never let one request take the engine down
                    continue
                if isinstance(msg, AddRequest):
                    loop.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time, msg.lora)
                elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                    loop.control_lora(msg)
                elif isinstance(msg, AbortRequest):
                    loop.abort(msg.request_id, msg.seq_index, msg.finish_reason)
                elif isinstance(msg, ArmFault):
                    if injector is not None:
                        injector.arm(msg.kind)
                elif isinstance(msg, Shutdown):
                    logger.info("engine process: shutdown requested")
                    return 0
        dead_worker = getattr(engine, "dead_worker", None)
        reason = dead_worker() if dead_worker is not None else None
        if reason is not None and loop.alive:   # fail the open requests on the loop thread, then exit 1
            logger.error("engine process: %s", reason)
            loop.kill(RuntimeError(reason))
        if not loop.alive:
            return EXIT_ENGINE_FAILED
        if os.getppid() != parent_pid:
            logger.error("engine process: the front end (pid %d) is gone; exiting", parent_pid)
            return 0
