"""What the HTTP front end costs: tokens/s delivered over SSE to concurrent streaming clients, against the
same engine run offline (engine.llm.LLM) on the same workload.

    python benchmarks/http_overhead.py                      # tiny-random on this machine's device
    python benchmarks/http_overhead.py --model /models/Qwen3-0.6B --num-clients 64 --max-tokens 256

Each side runs in its own subprocess with the same engine settings: the offline engine, and the server
(`python -m server serve`). The clients are one asyncio process speaking raw HTTP/1.1 on sockets and
only looking for the final usage chunk, so that client-side parsing takes as little CPU as possible away
from the server (on a small machine they share cores). Both sides generate exactly num_clients x
max_tokens tokens (ignore_eos, greedy), after a warm-up round; the sides alternate for --passes passes and
the best round of each is reported. Prints a JSON report; --out writes it to a file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.server.server_proc import ServerProcess  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads of both engines (OMP_NUM_THREADS). 1 keeps a CPU run like a GPU one: "
                        "the engine thread on one core, the rest free for the front end and the clients")
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per side and pass")
    p.add_argument("--passes", type=int, default=2, help="offline and HTTP alternate this many times")
    p.add_argument("--out", default=None, help="write the JSON report here too")
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (Linux /proc; its own threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """Every descendant of `pid` (the engine process of a two-process server)."""
    found, pending = [], [pid]
    while pending:
        for task in Path(f"/proc/{pending.pop()}/task").iterdir():
            kids = [int(k) for k in (task / "children").read_text().split()]
            found += kids
            pending += kids
    return found


def make_prompts(vocab_size: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    # Avoid the lowest ids (special tokens in the built-in tokenizer).
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, max_num_seqs=args.num_clients,
                max_model_len=args.prompt_len + args.max_tokens + 16)


def offline_worker(args: argparse.Namespace) -> None:
    """Runs in the subprocess: prints {"tok_per_s", "vocab_size"}."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompts = make_prompts(llm.engine.vocab_size, args.num_clients, args.prompt_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))   # warm-up
    best, cpu_us = 0.0, 0.0
    for _ in range(args.repeats):
        start, cpu0 = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        assert tokens == args.num_clients * args.max_tokens, tokens
        if tokens / elapsed > best:
            best, cpu_us = tokens / elapsed, 1e6 * cpu / tokens
    print(json.dumps({"tok_per_s": best, "cpu_us_per_token": cpu_us, "vocab_size": llm.engine.vocab_size}))


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.torch_threads), "MKL_NUM_THREADS": str(args.torch_threads)}


def run_offline(args: argparse.Namespace) -> dict:
    flags = ["--model", args.model, "--device", args.device, "--num-clients", str(args.num_clients),
             "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
             "--repeats", str(args.repeats), "--offline-worker"]
    out = subprocess.run([sys.executable, __file__, *flags], check=True, capture_output=True, text=True,
                         env=worker_env(args)).stdout
    return json.loads(out.strip().splitlines()[-1])


_USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def _one_stream(host: str, port: int, model: str, prompt: list[int], max_tokens: int) -> int:
    """One streaming request over a raw socket; returns the completion tokens of the final usage chunk."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    tail = b""
    while chunk := await reader.read(1 << 16):
        tail = (tail + chunk)[-4096:]
    writer.close()
    match = _USAGE.search(tail)
    return int(match.group(1)) if match else 0


async def _round(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    host, port = base_url.removeprefix("http://").split(":")
    start = time.perf_counter()
    counts = await asyncio.gather(*(_one_stream(host, int(port), model, p, max_tokens) for p in prompts))
    return sum(counts), time.perf_counter() - start


def run_http(args: argparse.Namespace, vocab_size: int) -> dict:
    """Best round's tok/s, with the CPU the front-end process (the server's own pid) and the engine process
    (its children, if any) spent per delivered token in that round."""
    kw = engine_kwargs(args)
    server = ServerProcess("--model", args.model, "--device", kw["device"], "--max-num-seqs", str(kw["max_num_seqs"]),
                           "--max-model-len", str(kw["max_model_len"]), "--log-level", "warning",
                           "--stream-interval", str(args.stream_interval),
                           env=worker_env(args)).wait_ready()
    try:
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        prompts = make_prompts(vocab_size, args.num_clients, args.prompt_len)
        asyncio.run(_round(server.base_url, model, prompts[:8], 8))      # warm-up
        best: dict = {"tok_per_s": 0.0}
        pids = [server.proc.pid, *child_pids(server.proc.pid)]
        for _ in range(args.repeats):
            before = [cpu_seconds(p) for p in pids]
            tokens, elapsed = asyncio.run(_round(server.base_url, model, prompts, args.max_tokens))
            used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
            assert tokens == args.num_clients * args.max_tokens, tokens
            if tokens / elapsed > best["tok_per_s"]:
                best = {"tok_per_s": tokens / elapsed, "frontend_cpu_us_per_token": 1e6 * used[0] / tokens,
                        "engine_cpu_us_per_token": 1e6 * sum(used[1:]) / tokens}
        return best
    finally:
        server.stop()


def main() -> None:
    args = parse_args()
    if args.offline_worker:
        offline_worker(args)
        return
    offline: dict = {"tok_per_s": 0.0}
    http: dict = {"tok_per_s": 0.0}
    for _ in range(args.passes):
        offline = max(offline, run_offline(args), key=lambda r: r["tok_per_s"])
        http = max(http, run_http(args, offline["vocab_size"]), key=lambda r: r["tok_per_s"])
    report = {"model": args.model, "device": args.device, "torch_threads": args.torch_threads,
              "num_clients": args.num_clients, "stream_interval": args.stream_interval,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "offline_tok_per_s": round(offline["tok_per_s"], 1), "http_sse_tok_per_s": round(http["tok_per_s"], 1),
              "http_percent_of_offline": round(100.0 * http["tok_per_s"] / offline["tok_per_s"], 1),
              "offline_cpu_us_per_token": round(offline["cpu_us_per_token"], 1),
              "server_frontend_process_cpu_us_per_token": round(http["frontend_cpu_us_per_token"], 1),
              "server_engine_process_cpu_us_per_token": round(http["engine_cpu_us_per_token"], 1),
              "load_average_1m": os.getloadavg()[0]}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
