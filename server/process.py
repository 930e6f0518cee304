"""The server process's life: uvicorn, plus a drain on SIGTERM and a non-zero exit when the engine dies.

SIGTERM/SIGINT: /health and new requests answer 503 at once while the port stays open (a refused connection
is not an answer a load balancer can act on); in-flight requests get --drain-timeout seconds; those still
running then end with finish_reason "abort"; uvicorn lets their last bytes out and the process exits 0.
A second signal cuts the drain short.

Engine death (its loop died, or its process was killed): every open request fails (500 / an SSE error event),
/health answers 503, and the process exits with status 1 about a second later so that a supervisor restarts
it. The engine process itself exits on its own when this process is gone (engine/core.py).
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

import uvicorn
from fastapi import FastAPI

from server.async_engine import AsyncEngine

logger = logging.getLogger("pagedserve")
EXIT_ENGINE_DIED = 1
# After the drain, how long uvicorn waits for connections to send their last bytes before cutting them.
_CONNECTION_GRACE_S = 5.0


class ManagedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, bridge: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.bridge = bridge
        self.drain_timeout = drain_timeout
        bridge.on_engine_death = self._on_engine_death

    def _on_engine_death(self) -> None:
        logger.error("the engine died (%s); exiting with status %d so that a supervisor restarts the server",
                     self.bridge.death_reason, EXIT_ENGINE_DIED)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal once it has shut down, which kills the process with that signal; a
        # drain that completes is a success, so the signal is not recorded. A second signal forces the exit.
        if self.should_exit:
            self.force_exit = True
        else:
            logger.info("received %s: draining (up to %.1f s)", signal.Signals(sig).name, self.drain_timeout)
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await self.bridge.drain(self.drain_timeout, lambda: self.force_exit)
        await super().shutdown(sockets)

    @property
    def exit_code(self) -> int:
        return EXIT_ENGINE_DIED if self.bridge.engine_dead else 0


def run_server(app: FastAPI, host: str, port: int, *, drain_timeout: float, log_level: str, access_log: bool) -> int:
    """Serves until a signal or the engine's death; returns the process exit status."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=_CONNECTION_GRACE_S)
    server = ManagedServer(config, app.state.ctx.async_engine, drain_timeout)
    freeze_startup_heap()
    server.run()
    return server.exit_code


def freeze_startup_heap() -> None:
    """Moves everything alive after start-up (torch, transformers, the tokenizer, the app: millions of
    objects) out of the garbage collector's sight. Otherwise each full collection while serving walks them
    all, a pause of about 0.2 s on the event loop (every stream stalls); objects made later are still
    collected as usual. Collect first: whatever garbage is frozen stays for good. (vLLM does the same.)"""
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> NoReturn:
    """Ends the process once the server has stopped. Python's own finalization (a second or more with torch
    loaded) is skipped: nothing is left to clean up but the logs, which are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
