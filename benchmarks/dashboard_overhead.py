"""What the dashboard costs: the same HTTP workload with and without a client polling GET /v1/stats every
500 ms (rounds alternate on one server), and on a server started with --no-dashboard (no per-step hook).

    python benchmarks/dashboard_overhead.py                   # tiny-random, CPU
    python benchmarks/dashboard_overhead.py --model /models/Qwen3-0.6B --device cuda --max-tokens 256

Reports per configuration the median and best tokens/s over the rounds, and the CPU the engine process and
the front-end process spent per delivered token (Linux /proc). /v1/stats never reaches the engine process,
so its CPU per token is the figure that must not move. Prints JSON; --out writes it to a file too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.http_overhead import _round, child_pids, cpu_seconds, make_prompts, worker_env  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-clients", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per configuration")
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", default=None)
    return p.parse_args()


async def _poll(base_url: str, interval: float, latencies: list[float], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as http:
        while not stop.is_set():
            start = time.perf_counter()
            response = await http.get("/v1/stats")
            assert response.status_code == 200, response.status_code
            latencies.append(time.perf_counter() - start)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


async def _timed_round(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                       poll_interval: float | None, latencies: list[float]) -> tuple[int, float]:
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll(base_url, poll_interval, latencies, stop)) if poll_interval else None
    try:
        return await _round(base_url, model, prompts, max_tokens)
    finally:
        stop.set()
        if poller is not None:
            await poller


def start(args: argparse.Namespace, *extra: str) -> ServerProcess:
    return ServerProcess("--model", args.model, "--device", args.device, "--max-num-seqs", str(args.num_clients),
                         "--max-model-len", str(args.prompt_len + args.max_tokens + 16), "--log-level", "warning",
                         *extra, env=worker_env(args)).wait_ready()


def measure(server: ServerProcess, args: argparse.Namespace, configs: dict[str, float | None]) -> dict[str, dict]:
    """Rounds alternate between the configurations (name -> poll interval or None) on one server."""
    info = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "The quick brown fox. " * 200}).json()["tokens"]
    prompts = make_prompts(max(ids) + 1, args.num_clients, args.prompt_len)   # ids the tokenizer surely has
    asyncio.run(_round(server.base_url, info["id"], prompts[:8], 8))      # warm-up
    pids = [server.proc.pid, *child_pids(server.proc.pid)]
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    latencies: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, interval in configs.items():
            before = [cpu_seconds(p) for p in pids]
            tokens, elapsed = asyncio.run(_timed_round(server.base_url, info["id"], prompts, args.max_tokens,
                                                       interval, latencies[name]))
            used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
            assert tokens == args.num_clients * args.max_tokens, tokens
            runs[name].append({"tok_per_s": tokens / elapsed, "frontend_cpu_us_per_token": 1e6 * used[0] / tokens,
                               "engine_cpu_us_per_token": 1e6 * sum(used[1:]) / tokens})
    return {name: summarize(runs[name], latencies[name]) for name in configs}


def summarize(runs: list[dict], latencies: list[float]) -> dict:
    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in runs), 1)
    out = {"tok_per_s_median": med("tok_per_s"), "tok_per_s_best": round(max(r["tok_per_s"] for r in runs), 1),
           "tok_per_s_all": [round(r["tok_per_s"], 1) for r in runs],
           "engine_cpu_us_per_token_median": med("engine_cpu_us_per_token"),
           "frontend_cpu_us_per_token_median": med("frontend_cpu_us_per_token")}
    if latencies:
        out["stats_requests"] = len(latencies)
        out["stats_latency_ms_median"] = round(1e3 * statistics.median(latencies), 2)
    return out


def main() -> None:
    args = parse_args()
    server = start(args)
    try:
        report = measure(server, args, {"dashboard_idle": None, "polling_every_500ms": args.poll_interval})
    finally:
        server.stop()
    server = start(args, "--no-dashboard")
    try:
        report.update(measure(server, args, {"no_dashboard": None}))
    finally:
        server.stop()
    report = {"model": args.model, "device": args.device, "num_clients": args.num_clients,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "load_average_1m": os.getloadavg()[0], **report}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
