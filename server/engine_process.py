"""The engine in its own process, behind ZMQ: the EngineClient that `pagedserve serve` uses.

The front end binds two IPC sockets in a private temporary directory and spawns the engine process
(engine/core.py), which connects to them. Start-up blocks until the engine says EngineReady (with its
ModelInfo) or EngineFailed; a child that dies without a word is reported by its exit status.

After that, everything happens on the event loop: step outputs are read when the socket's file descriptor
becomes readable (every queued message at once, so a front end that fell behind catches up in one pass),
and the process's sentinel reports its death at once, even by SIGKILL.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
from pathlib import Path

import zmq

from engine.config import EngineConfig
from engine.core import EngineFactory, run_engine_process
from engine.messages import (
    AbortRequest,
    AddRequest,
    ArmFault,
    EngineFailed,
    EngineReady,
    LoRAControl,
    Shutdown,
    StepOutput,
    input_codec,
    output_codec,
)
from engine.model_info import ModelInfo
from server.engine_client import OnDeath, OnOutput

logger = logging.getLogger("pagedserve.server")
_STARTUP_POLL_MS = 100


class EngineStartupError(Exception):
    """The engine process could not start; the message is the engine's own explanation."""


class ProcessEngineClient:
    def __init__(self, config: EngineConfig, *, log_level: str = "info",
                 engine_factory: EngineFactory | None = None) -> None:
        """Starts the engine process and waits until it is ready (EngineStartupError if it cannot start)."""
        self._dir = Path(tempfile.mkdtemp(prefix="pagedserve-"))
        self._zmq = zmq.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        self._encoder, _ = input_codec()
        _, self._decoder = output_codec()
        spawn = multiprocessing.get_context("spawn")   # a fresh interpreter: no inherited threads or CUDA state
        self.process = spawn.Process(target=run_engine_process, name="pagedserve-engine", args=(
            config, input_addr, output_addr, multiprocessing.current_process().pid, log_level, engine_factory))
        self._alive = False
        self._death_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_output: OnOutput | None = None
        self._on_death: OnDeath | None = None
        self._outbox: list[bytes] = []      # encoded inputs waiting for the end of this event-loop pass
        try:
            self.process.start()
            self._info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self._alive = True

    def _wait_ready(self) -> ModelInfo:
        while not self._output.poll(_STARTUP_POLL_MS):
            if not self.process.is_alive() and not self._output.poll(_STARTUP_POLL_MS):
                raise EngineStartupError(f"the engine process exited with status {self.process.exitcode} "
                                         "while starting (see its log above)")
        msg = self._decoder.decode(self._output.recv())
        if isinstance(msg, EngineFailed):
            self.process.join(5.0)
            raise EngineStartupError(msg.error)
        if not isinstance(msg, EngineReady):
            raise EngineStartupError(f"the engine process sent {type(msg).__name__} before it was ready")
        return msg.info

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def pid(self) -> int | None:
        return self.process.pid

    # --- event loop side -------------------------------------------------------------------------------
    def start(self, on_output: OnOutput, on_death: OnDeath) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_output, self._on_death = on_output, on_death
        self._loop.add_reader(self._output.getsockopt(zmq.FD), self._read_outputs)
        self._loop.add_reader(self.process.sentinel, self._process_exited)
        self._read_outputs()     # the descriptor is edge-triggered: drain what came before the reader

    def _read_outputs(self) -> None:
        """Every queued message, in order. ZMQ's descriptor only signals a change, so read until empty."""
        output = self._output
        while output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = self._decoder.decode(output.recv(zmq.NOBLOCK, copy=False))
            if isinstance(msg, StepOutput):
                self._on_output(msg)
            elif isinstance(msg, EngineFailed):
                self._died(msg.error)

    def _process_exited(self) -> None:
        self._loop.remove_reader(self.process.sentinel)
        self._read_outputs()     # the last step's failures and the reason, if it managed to send them
        self.process.join(1.0)
        self._died(f"the engine process exited with status {self.process.exitcode}")

    def _died(self, reason: str) -> None:
        if self._death_reason is not None or not self._alive:
            return
        self._death_reason, self._alive = reason, False
        logger.error("the engine died: %s", reason)
        self._on_death(reason)

    def add(self, request: AddRequest) -> None:
        self._send(self._encoder.encode(request))

    def abort(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None:
        if self._alive:
            self._send(self._encoder.encode(AbortRequest(request_id, seq_index, finish_reason)))

    def control_lora(self, control: LoRAControl) -> None:
        self._send(self._encoder.encode(control))

    def arm_fault(self, kind: str) -> None:
        self._send(self._encoder.encode(ArmFault(kind)))

    def _send(self, msg: bytes) -> None:
        """Queues `msg` and sends it, in order with the others, at the end of this event-loop pass. A
        send after a quiet moment wakes ZMQ's I/O thread (tens of µs on a small machine); sends back to
        back do not, so a burst of requests handled in one pass pays that once."""
        if self._loop is None:
            self._input.send(msg)
            return
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(msg)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for msg in outbox:
            # By copy: a zero-copy send (copy=False) returns the buffer through pyzmq's garbage-collector
            # thread, which costs more than copying a message this small (pyzmq advises copy below ~64 KB).
            self._input.send(msg)

    async def shutdown(self, timeout: float) -> None:
        was_alive, self._alive = self._alive, False
        if self._loop is not None:
            self._loop.remove_reader(self._output.getsockopt(zmq.FD))
            self._loop.remove_reader(self.process.sentinel)
        if was_alive and self.process.is_alive():
            self._flush()
            self._input.send(self._encoder.encode(Shutdown()))
            await asyncio.to_thread(self.process.join, timeout)
        self._kill()

    def _kill(self) -> None:
        """Whatever state it is in, the engine process is gone afterwards, and so are the sockets."""
        if self.process.is_alive():
            self.process.join(3.0)      # it may be on its way out already (a failed loop, a shutdown)
        if self.process.is_alive():
            logger.warning("the engine process did not exit; killing it")
            self.process.kill()
            self.process.join(5.0)
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
