"""Several `pagedserve serve` replicas behind an existing router (vllm-router or sglang-router), as real
processes on loopback ports; shared by tests/replicas and benchmarks/routers.py."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_proc import REPO_ROOT, ServerProcess, free_port, wait_for_200

# The router packages' Python modules (their launchers wrap the Rust router in the same wheel).
ROUTER_MODULES = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}
_QUIET = {"vllm-router": "warning", "sglang-router": "warn"}      # their --log-level spellings differ
REPLICA_FLAGS = ("--model", "tiny-random", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8",
                 "--vllm-metric-names")


def router_installed(router: str) -> bool:
    """In this interpreter's environment (the tests run the router with it)."""
    return importlib.util.find_spec(ROUTER_MODULES[router].split(".")[0]) is not None


def router_command(router: str, port: int, metrics_port: int, worker_urls: list[str], policy: str,
                   python: str | None = None) -> list[str]:
    """Health checks every second, a worker marked down after 1 failure: failover within ~1 s on a
    loopback test (the routers' defaults, 60 s / 3 failures, suit real clusters)."""
    return [python or sys.executable, "-m", ROUTER_MODULES[router], "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port), "--worker-urls", *worker_urls, "--policy", policy,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", _QUIET[router]]


@dataclass
class RouterProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: str

    @classmethod
    def start(cls, router: str, worker_urls: list[str], policy: str = "round_robin",
              python: str | None = None) -> RouterProcess:
        port = free_port()
        log = tempfile.NamedTemporaryFile("w+", prefix=f"{router}-", suffix=".log", delete=False)
        cmd = router_command(router, port, free_port(), worker_urls, policy, python)
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(proc, f"http://127.0.0.1:{port}", log.name)

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 60.0) -> RouterProcess:
        """Ready once it lists the workers' model (its /v1/models is forwarded to a healthy worker)."""
        wait_for_200(self.proc, self.base_url + "/v1/models", timeout, "router", self.log_tail, self.stop)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_replicas(count: int, *extra: str) -> list[ServerProcess]:
    """Started together (their startups overlap), then waited for."""
    replicas = [ServerProcess(*REPLICA_FLAGS, *extra) for _ in range(count)]
    try:
        return [r.wait_ready() for r in replicas]
    except Exception:
        for r in replicas:
            r.stop()
        raise


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of a replica's /metrics, summed over the label values not given."""
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def finished_requests(base_url: str) -> float:
    return metric(base_url, "pagedserve_request_success_total")


def sigkill(replica: ServerProcess) -> None:
    """The front-end process dies at once; its engine process notices and exits on its own."""
    replica.proc.send_signal(signal.SIGKILL)
    replica.proc.wait(10)
