"""Starts the real server (`pagedserve serve`) as a subprocess on a free port, and stops it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_200(proc: subprocess.Popen, url: str, timeout: float, what: str, log_tail: Callable[[], str],
                 stop: Callable[[], object]) -> None:
    """Polls url until it answers 200; on exit of proc or timeout: stop it and raise with its log's tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop()
    raise RuntimeError(f"{what} not ready after {timeout}s:\n{log_tail()}")


def serve_command() -> list[str]:
    """The console script of this interpreter's environment when installed, else `python -m server`."""
    script = Path(sys.executable).parent / "pagedserve"
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "server", "serve"]


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-test-", suffix=".log", delete=False)
        cmd = [*serve_command(), "--host", "127.0.0.1", "--port", str(self.port), "--no-access-log", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        wait_for_200(self.proc, self.base_url + "/health", timeout, "server", self.log_tail, self.stop)
        return self

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
