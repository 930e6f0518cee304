"""Front-end capacity: how many streamed tokens/s the HTTP front end delivers when the engine is fast.

    python benchmarks/frontend_capacity.py                        # 256 streams, 8 ms steps = 32,000 tok/s
    python benchmarks/frontend_capacity.py --step-ms 4 --num-streams 128 --profile /tmp/frontend.prof

The server is the real one (`server.app.create_app` over the real engine process and ZMQ wire), with the
engine replaced by benchmarks/sim_engine.py: each step takes --step-ms with the GIL released, as a GPU step
does, and gives each of up to --num-streams running requests one token. So the engine can deliver
num_streams / step time tokens/s, and whatever the clients get less than that is the front end's cost.
The clients are one epoll loop over raw sockets in this process (a few µs per read), not asyncio, so that
on a small machine they take as little CPU as possible from the server. Prints a JSON report: delivered
tok/s, the ideal and the simulated engine's own rate, and the CPU each process spent per token. The
delivered rate counts from the first connection to the last stream's end, so it includes the burst of
num_streams requests going through HTTP at once (`all_streams_started_s`: when the last stream got its
first token); `steady_*` is the rate while every stream runs (from the median stream's token spacing).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path[:0] = [str(REPO_ROOT), str(BENCH_DIR)]

from http_overhead import child_pids, cpu_seconds  # noqa: E402
from sim_engine import STEP_MS_ENV, SimEngine  # noqa: E402

from tests.server.server_proc import free_port  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=8.0, help="the simulated engine's step time")
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the best is reported")
    p.add_argument("--profile", default=None, help="cProfile the front end's process into this file")
    p.add_argument("--out", default=None, help="write the JSON report here too")
    p.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def serve(args: argparse.Namespace) -> None:
    """The server process: the real front end over the real engine process, running SimEngine."""
    from engine.config import EngineConfig
    from server.app import create_app
    from server.engine_process import ProcessEngineClient
    from server.process import exit_now, run_server

    config = EngineConfig(max_num_seqs=args.num_streams, max_model_len=args.max_tokens + 64)
    client = ProcessEngineClient(config, log_level="warning", engine_factory=SimEngine)
    app = create_app(client, stream_interval=args.stream_interval, max_queue_len=4 * args.num_streams)
    run = lambda: run_server(app, "127.0.0.1", args.serve_port, drain_timeout=1.0,  # noqa: E731
                             log_level="warning", access_log=False)
    if args.profile is None:
        exit_now(run())
    import cProfile
    profiler = cProfile.Profile(time.process_time)   # CPU time: a busy machine does not skew it
    code = profiler.runcall(run)
    profiler.dump_stats(args.profile)
    exit_now(code)


@dataclass
class Round:
    tokens: int
    seconds: float              # from the first connection to the last stream's end
    all_started_s: float        # when the last stream got its first token (all requests admitted)
    step_s: float               # the median stream's time between two tokens, once it streams


def stream_round(port: int, num_streams: int, max_tokens: int) -> Round:
    """num_streams streaming completions at once, read to the end."""
    body = json.dumps({"model": "sim", "prompt": [11, 12, 13, 14], "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    poller, socks, tails = select.epoll(), {}, {}
    first: dict[int, float] = {}        # fd -> when its first event arrived
    spans: list[float] = []             # per stream: first event to end
    start = time.perf_counter()
    for _ in range(num_streams):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request)
        sock.setblocking(False)
        socks[sock.fileno()], tails[sock.fileno()] = sock, b""
        poller.register(sock.fileno(), select.EPOLLIN)
    done: list[bytes] = []
    all_started = 0.0
    while socks:
        for fd, _ in poller.poll():
            data = socks[fd].recv(1 << 16)
            if data:
                if fd not in first and b"data:" in data:
                    first[fd] = time.perf_counter()
                    all_started = first[fd] - start
                tails[fd] = (tails[fd] + data)[-1024:]
                continue
            poller.unregister(fd)
            socks.pop(fd).close()
            done.append(tails.pop(fd))
            spans.append(time.perf_counter() - first.pop(fd))
    elapsed = time.perf_counter() - start
    tokens = 0
    for tail in done:
        marker = tail.rfind(b'"completion_tokens":')
        tokens += int(tail[marker + 20:].split(b",")[0]) if marker >= 0 else 0
    return Round(tokens, elapsed, all_started, sorted(spans)[len(spans) // 2] / max(1, max_tokens - 1))


def sim_engine_rate(args: argparse.Namespace) -> float:
    """The simulated engine alone, stepping in this process: the most any front end could deliver."""
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams

    engine = SimEngine(EngineConfig(max_num_seqs=args.num_streams, max_model_len=args.max_tokens + 64))
    params = SamplingParams(max_tokens=args.max_tokens)
    for i in range(args.num_streams):
        engine.add_request(str(i), [11, 12, 13, 14], params)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    args = parse_args()
    if args.serve_port is not None:
        serve(args)
        return
    port = free_port()
    cmd = [sys.executable, __file__, "--serve-port", str(port), "--num-streams", str(args.num_streams),
           "--max-tokens", str(args.max_tokens), "--stream-interval", str(args.stream_interval)]
    if args.profile:
        cmd += ["--profile", args.profile]
    env = {**os.environ, STEP_MS_ENV: str(args.step_ms)}
    server = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        stream_round(port, 8, 8)       # warm-up
        pids = [server.pid, *child_pids(server.pid)]
        best: dict = {"tok_per_s": 0.0}
        for _ in range(args.repeats):
            before, client0 = [cpu_seconds(p) for p in pids], time.process_time()
            r = stream_round(port, args.num_streams, args.max_tokens)
            used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
            client = time.process_time() - client0
            assert r.tokens == args.num_streams * args.max_tokens, r.tokens
            if r.tokens / r.seconds > best["tok_per_s"]:
                best = {"tok_per_s": r.tokens / r.seconds, "frontend_cpu_us_per_token": 1e6 * used[0] / r.tokens,
                        "engine_process_cpu_us_per_token": 1e6 * sum(used[1:]) / r.tokens,
                        "client_cpu_us_per_token": 1e6 * client / r.tokens,
                        "all_streams_started_s": r.all_started_s, "steady_step_ms": 1e3 * r.step_s}
    finally:
        server.terminate()
        server.wait(30)
    ideal = args.num_streams / (args.step_ms / 1000)
    alone = sim_engine_rate(args)
    report = {"num_streams": args.num_streams, "max_tokens": args.max_tokens, "step_ms": args.step_ms,
              "stream_interval": args.stream_interval, "ideal_tok_per_s": round(ideal),
              "sim_engine_alone_tok_per_s": round(alone), "http_tok_per_s": round(best["tok_per_s"]),
              "http_percent_of_ideal": round(100 * best["tok_per_s"] / ideal, 1),
              # Once every stream runs (after the burst of requests went through HTTP): each gets one token
              # per step, so the streams' token spacing is the rate the front end sustains to all of them.
              "steady_http_tok_per_s": round(args.num_streams / (best["steady_step_ms"] / 1e3)),
              "steady_percent_of_ideal": round(100 * args.step_ms / best["steady_step_ms"], 1),
              **{k: round(v, 3 if k.endswith("_s") else 2 if k.endswith("_ms") else 1)
                 for k, v in best.items() if k != "tok_per_s"},
              "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
