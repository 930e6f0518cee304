"""What the dashboard costs: the same HTTP workload with and without a client polling GET /v1/stats every
500 ms, and on a second server started with --no-dashboard (no per-step hook); rounds alternate.

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
import math
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
    p.add_argument("--micro-only", action="store_true", help="only time the collector's hook and snapshot "
                   "in-process (no server)")
    return p.parse_args()


def micro(batch: int = 64, steps: int = 2000) -> dict:
    """In-process front-end cost: StatsCollector.on_step for a decode step of `batch` requests, and one
    /v1/stats snapshot with a full 300 s ring and 32 timelines."""
    from engine.messages import StepOutput
    from engine.model_info import ModelInfo, TokenizerSource
    from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta, StepStats
    from server.dashboard.collector import HISTORY_S, DashboardOptions, StatsCollector
    from server.metrics import ServerMetrics

    info = ModelInfo("m", 4096, 32000, (), 4096, 16, batch, TokenizerSource("/nonexistent"), weight_bytes=10**9,
                     kv_bytes_per_token=10**5, memory_bandwidth=3e12)
    metrics = ServerMetrics("m", 4096)
    t0 = time.monotonic() - HISTORY_S
    collector = StatsCollector(info, metrics, "m", "0", DashboardOptions(), started=t0)
    ids = [f"r{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        collector.on_submit(rid, list(range(100)), t0)
    timings = RequestTimings(t0, t0, t0)
    output = StepOutput([RequestDelta(rid, [SequenceDelta(0, [5])], False, 100, 0, timings) for rid in ids],
                        EngineStats(batch, 0, 0.5, kv_blocks_used=500, step=StepStats(0.01, 0, batch, batch * 500)))
    for second in range(HISTORY_S):                                 # fill the ring
        collector.tick(t0 + second)
    start = time.perf_counter()
    for second in range(20):
        collector.tick(t0 + second)
    per_tick = (time.perf_counter() - start) / 20
    collector.timelines.active = {rid: collector.timelines.active[rid] for rid in ids}
    start = time.perf_counter()
    for k in range(steps):
        collector.on_step(output, t0 + HISTORY_S - 20 + k / 100)      # 100 steps/s: a tick every 100 steps
    per_step = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(20):
        snap = collector.snapshot(t0 + HISTORY_S)
    per_snapshot = (time.perf_counter() - start) / 20
    assert len(snap["requests"]) == 32 and len(snap["series"]["seconds_ago"]) == HISTORY_S
    return {"on_step_us_per_step_of_%d" % batch: round(1e6 * per_step, 1), "tick_ms": round(1e3 * per_tick, 2),
            "snapshot_ms": round(1e3 * per_snapshot, 2), "snapshot_json_bytes": len(json.dumps(snap))}


async def _poll(base_url: str, interval: float, latencies: list[float], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as http:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                response = await http.get("/v1/stats")
            except httpx.TransportError:        # counted as NaN: the report says how many failed
                latencies.append(math.nan)
            else:
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


def measure(args: argparse.Namespace, configs: dict[str, tuple[ServerProcess, float | None]]) -> dict[str, dict]:
    """Rounds alternate between the configurations (name -> server, poll interval or None), so that a change
    in the machine's load hits them all alike."""
    first = next(iter(configs.values()))[0]
    model = httpx.get(first.base_url + "/v1/models").json()["data"][0]["id"]
    ids = httpx.post(first.base_url + "/tokenize", json={"prompt": "The quick brown fox. " * 200}).json()["tokens"]
    prompts = make_prompts(max(ids) + 1, args.num_clients, args.prompt_len)   # ids the tokenizer surely has
    for server, _ in configs.values():
        asyncio.run(_round(server.base_url, model, prompts[:8], 8))      # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    latencies: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (server, interval) in configs.items():
            pids = [server.proc.pid, *child_pids(server.proc.pid)]
            before = [cpu_seconds(p) for p in pids]
            tokens, elapsed = asyncio.run(_timed_round(server.base_url, model, prompts, args.max_tokens,
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
        ok = [v for v in latencies if not math.isnan(v)]
        out["stats_requests"] = len(latencies)
        out["stats_transport_errors"] = len(latencies) - len(ok)
        out["stats_latency_ms_median"] = round(1e3 * statistics.median(ok), 2) if ok else None
    return out


def main() -> None:
    args = parse_args()
    if args.micro_only:
        print(json.dumps(micro(), indent=2))
        return
    with_dashboard = start(args)
    without = start(args, "--no-dashboard")
    try:
        report = measure(args, {"dashboard_idle": (with_dashboard, None),
                                "polling_every_500ms": (with_dashboard, args.poll_interval),
                                "no_dashboard": (without, None)})
    finally:
        with_dashboard.stop()
        without.stop()
    report = {"model": args.model, "device": args.device, "num_clients": args.num_clients,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "load_average_1m": os.getloadavg()[0], **report, "in_process": micro()}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
