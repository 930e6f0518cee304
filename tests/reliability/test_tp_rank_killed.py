"""A tensor-parallel worker rank SIGKILLed mid-run: every open request fails (500 envelope, or an SSE
error event then [DONE]), the server exits 1, and no rank is left running. The requests are in flight at the
kill by construction (test_processes.py's held engine)."""
from __future__ import annotations

import asyncio
import os
import re
import signal

from tests.reliability.helpers import FAULTS, engine_pid, process_gone, wait_gone
from tests.reliability.test_engine_faults import check_failed
from tests.reliability.test_processes import _open_requests
from tests.server.conftest import start_server
from tests.server.prom import GUARD_S


def test_killed_rank_fails_the_server_cleanly(tiny_checkpoint) -> None:
    server = start_server(tiny_checkpoint, "--max-model-len", "512", "--tensor-parallel-size", "2",
                          env={"PAGEDSERVE_TP_TIMEOUT_S": "20", **FAULTS})
    try:
        log = server.log_tail(200_000)
        match = re.search(r"worker pids ([\d,]+)", log)
        assert match, log
        worker = int(match.group(1).split(",")[0])
        engine = engine_pid(server)
        outcomes = asyncio.run(_open_requests(server.base_url, lambda: os.kill(worker, signal.SIGKILL)))
        for outcome in outcomes:
            check_failed(outcome, 500)
        assert server.proc.wait(timeout=GUARD_S) == 1
        wait_gone(engine, GUARD_S)
        assert process_gone(worker)
        assert "tensor-parallel rank 1" in server.log_tail(200_000)
    finally:
        server.stop()
