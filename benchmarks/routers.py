"""Two pagedserve replicas behind each router: how requests spread, what a SIGKILLed replica costs, and the
latency the router adds. The figures in docs/replicas.md come from this script.

    python benchmarks/routers.py --router vllm-router=/tmp/rt-vllm/bin/python \
                                 --router sglang-router=/tmp/rt-sgl/bin/python

Each `--router NAME=PYTHON` names a router package and the interpreter of the environment it is installed
in (each router has its own: they pin different dependencies). For each router: two fresh tiny-random CPU
replicas, the router in front (round_robin unless --policy), then
  overhead  --requests sequential 1-token completions straight to a replica and through the router, in turns;
  spread    --requests completions, 4 at a time, through the router; each replica's finished-request counter;
  failover  2 clients loop for --failover-seconds; replica 2 gets SIGKILL after a third of it; every
            request's status is kept (failures after the kill, time to the last failure).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.replicas.cluster import RouterProcess, finished_requests, sigkill, start_replicas  # noqa: E402

BODY = {"model": "tiny-random", "prompt": "The replicas behind the router", "max_tokens": 1}


def latencies_ms(urls: list[str], count: int) -> list[list[float]]:
    """Per URL, `count` sequential request latencies; the URLs take turns, so that both paths see the same
    machine load (a shared 2-core machine is noisy)."""
    out: list[list[float]] = [[] for _ in urls]
    clients = [httpx.Client(base_url=url, timeout=30.0) for url in urls]
    try:
        for _ in range(count):
            for http, times in zip(clients, out):
                start = time.perf_counter()
                assert http.post("/v1/completions", json=BODY).status_code == 200
                times.append((time.perf_counter() - start) * 1000)
    finally:
        for http in clients:
            http.close()
    return out


def summary(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"p50_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2)}


def spread(router_url: str, replica_urls: list[str], count: int) -> dict[str, int]:
    before = [finished_requests(u) for u in replica_urls]
    with httpx.Client(base_url=router_url, timeout=60.0) as http, ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: http.post("/v1/completions", json=BODY).status_code, range(count)))
    assert statuses == [200] * count, statuses
    return {u: int(finished_requests(u) - b) for u, b in zip(replica_urls, before)}


def failover(router_url: str, replicas, seconds: float) -> dict[str, object]:
    results: list[tuple[float, int]] = []        # (seconds since start, status; 0 = transport error)
    start, stop = time.monotonic(), threading.Event()
    body = {**BODY, "max_tokens": 8}

    def client() -> None:
        with httpx.Client(base_url=router_url, timeout=30.0) as http:
            while not stop.is_set():
                try:
                    status = http.post("/v1/completions", json=body).status_code
                except httpx.TransportError:
                    status = 0
                results.append((time.monotonic() - start, status))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(seconds / 3)
    killed_at = time.monotonic() - start
    sigkill(replicas[1])
    time.sleep(2 * seconds / 3)
    stop.set()
    for t in threads:
        t.join()
    after = [(t, s) for t, s in results if t >= killed_at]
    failures = [(t, s) for t, s in after if s != 200]
    return {"requests_after_kill": len(after), "failed_after_kill": len(failures),
            "failure_statuses": sorted({s for _, s in failures}),
            "last_failure_s_after_kill": round(max((t for t, _ in failures), default=killed_at) - killed_at, 2),
            "ok_after_kill": len(after) - len(failures)}


def measure(router: str, python: str, policy: str, requests: int, failover_seconds: float) -> dict[str, object]:
    replicas = start_replicas(2)
    urls = [r.base_url for r in replicas]
    proxy = None
    try:
        started = time.monotonic()
        proxy = RouterProcess.start(router, urls, policy, python).wait_ready()
        ready_s = round(time.monotonic() - started, 2)
        latencies_ms([urls[0], proxy.base_url], 5)       # warm-up of both paths
        direct, routed = map(summary, latencies_ms([urls[0], proxy.base_url], requests))
        return {"router": router, "policy": policy, "ready_s": ready_s,
                "overhead": {"direct": direct, "routed": routed,
                             "added_p50_ms": round(routed["p50_ms"] - direct["p50_ms"], 2)},
                "spread": spread(proxy.base_url, urls, requests),
                "failover": failover(proxy.base_url, replicas, failover_seconds)}
    finally:
        if proxy is not None:
            proxy.stop()
        for r in replicas:
            r.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", action="append", required=True, metavar="NAME=PYTHON")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--failover-seconds", type=float, default=12.0)
    args = parser.parse_args()
    for spec in args.router:
        name, _, python = spec.partition("=")
        print(json.dumps(measure(name, python or sys.executable, args.policy, args.requests, args.failover_seconds)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
