"""Soak test: mixed traffic against one server for a long time, watching memory and the KV cache.

    python benchmarks/soak.py --minutes 30 --concurrency 8          # starts a tiny-random CPU server itself
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --minutes 5

The clients draw from a mix of requests: plain and streamed completions and chats, n > 1, logprobs, stop
strings, shared prompt prefixes, clients that disconnect mid-stream or mid-wait, bad requests (expecting
400), tokenize calls, and now and then a burst beyond the queue (expecting some 429s). The server's RSS
(from /proc) and /metrics (KV usage, running, waiting) are sampled every --sample-every seconds.

At the end the server must be idle again (nothing running or waiting, KV usage back to where it started) and
serve a normal request. Prints a JSON report: request outcomes, anomalies (a 5xx, an unexpected status, a
stream without [DONE]), and RSS / KV usage at the start (after warm-up), at the end and at their maximum.
--out writes the report and the samples to a file.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.server.server_proc import ServerProcess  # noqa: E402

PROMPTS = ["The history of the city begins", "Once upon a time", "In the beginning the engineers wrote",
           "A list of things to remember:", "def main():", "Dear diary, today"]
SHARED_PREFIX = "You are a careful assistant. Answer briefly and precisely. " * 6
BAD_BODIES = [{"prompt": "hi", "temperature": -1}, {"prompt": "hi", "n": 0}, {"prompt": ""},
              {"prompt": [10_000_000]}, {"prompt": "hi", "logit_bias": {"5": 500}}, {"prompt": "hi", "max_tokens": 10**9}]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--url", help="an already running server (default: start a tiny-random CPU server)")
    p.add_argument("--pid", type=int, help="that server's process id, for RSS samples")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup-s", type=float, default=60.0, help="the 'start' figures are taken after this")
    p.add_argument("--burst-every", type=float, default=120.0, help="seconds between overload bursts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report and samples (JSON) here")
    return p.parse_args()


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    wanted = ("pagedserve_kv_cache_usage_perc", "pagedserve_num_requests_running", "pagedserve_num_requests_waiting")
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in wanted:
            out[name.removeprefix("pagedserve_")] = float(line.rsplit(" ", 1)[1])
    return out


class Traffic:
    """One kind of request per call, drawn at random; every outcome is counted, the odd ones recorded."""

    def __init__(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        self.client, self.rng = client, rng
        self.outcomes: Counter[str] = Counter()
        self.anomalies: list[str] = []
        self.kinds = [(self.completion, 5), (self.stream, 5), (self.chat, 3), (self.chat_stream, 3),
                      (self.leave_stream, 2), (self.leave_wait, 1), (self.bad, 1), (self.tokenize, 1)]

    def _expect(self, kind: str, status: int, allowed: tuple[int, ...] = (200, 429)) -> int:
        self.outcomes[f"{kind}:{status}"] += 1
        if status not in allowed:
            self.anomalies.append(f"{kind}: HTTP {status}")
        return status

    def _sampling(self) -> dict[str, Any]:
        r = self.rng
        body: dict[str, Any] = {"max_tokens": r.randint(4, 64), "temperature": r.choice([0.0, 0.7, 1.0])}
        if r.random() < 0.2:
            body["n"] = r.randint(2, 4)
        if r.random() < 0.2:
            body["stop"] = [r.choice(["e", "the", "\n"])]
        if r.random() < 0.2:
            body["ignore_eos"] = True
        return body

    def _prompt(self) -> str:
        prompt = self.rng.choice(PROMPTS)
        return SHARED_PREFIX + prompt if self.rng.random() < 0.3 else prompt

    async def one(self) -> None:
        kind = self.rng.choices([k for k, _ in self.kinds], weights=[w for _, w in self.kinds])[0]
        try:
            status = await kind()
        except httpx.HTTPError as exc:
            self.outcomes[f"{kind.__name__}:{type(exc).__name__}"] += 1
            self.anomalies.append(f"{kind.__name__}: {type(exc).__name__} {exc}")
            return
        if status == 429:      # as a polite client does: wait about Retry-After (1 s)
            await asyncio.sleep(self.rng.uniform(0.5, 1.0))

    async def completion(self) -> int | None:
        body = {"prompt": self._prompt(), **self._sampling()}
        if self.rng.random() < 0.3:
            body["logprobs"] = 3
        r = await self.client.post("/v1/completions", json=body)
        if self._expect("completion", r.status_code) == 200 and len(r.json()["choices"]) != body.get("n", 1):
            self.anomalies.append("completion: wrong number of choices")
        return r.status_code

    async def _read_stream(self, kind: str, path: str, body: dict[str, Any]) -> int:
        async with self.client.stream("POST", path, json={**body, "stream": True}) as r:
            text = (await r.aread()).decode()
        self._expect(kind, r.status_code)
        if r.status_code == 200 and not text.endswith("data: [DONE]\n\n"):
            self.anomalies.append(f"{kind}: stream without [DONE]")
        if r.status_code == 200 and '"error"' in text:
            self.anomalies.append(f"{kind}: error event {text[-200:]!r}")
        return r.status_code

    async def stream(self) -> int | None:
        body = {"prompt": self._prompt(), **self._sampling(), "stream_options": {"include_usage": True}}
        return await self._read_stream("stream", "/v1/completions", body)

    def _chat_body(self) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": self._prompt()}], **self._sampling()}
        if self.rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=5)
        return body

    async def chat(self) -> int | None:
        r = await self.client.post("/v1/chat/completions", json=self._chat_body())
        return self._expect("chat", r.status_code)

    async def chat_stream(self) -> int | None:
        return await self._read_stream("chat_stream", "/v1/chat/completions", self._chat_body())

    async def leave_stream(self) -> int | None:
        """Reads a couple of events, then disconnects."""
        body = {"prompt": self._prompt(), "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break
        return self._expect("leave_stream", r.status_code)

    async def leave_wait(self) -> int | None:
        """A plain request whose client gives up before the answer."""
        body = {"prompt": self._prompt(), "max_tokens": 200, "ignore_eos": True}
        try:
            r = await self.client.post("/v1/completions", json=body, timeout=0.3)
            return self._expect("leave_wait", r.status_code)
        except httpx.TimeoutException:
            self.outcomes["leave_wait:gave_up"] += 1
            return None

    async def bad(self) -> int | None:
        r = await self.client.post("/v1/completions", json=self.rng.choice(BAD_BODIES))
        return self._expect("bad", r.status_code, allowed=(400,))

    async def tokenize(self) -> int | None:
        r = await self.client.post("/tokenize", json={"prompt": self._prompt()})
        return self._expect("tokenize", r.status_code, allowed=(200,))

    async def burst(self, size: int) -> None:
        """More requests at once than the queue takes: the excess must be 429s, the rest complete."""
        async def one() -> int:
            body = {"prompt": self._prompt(), "max_tokens": 32, "ignore_eos": True}
            return (await self.client.post("/v1/completions", json=body)).status_code
        for status in await asyncio.gather(*(one() for _ in range(size))):
            self._expect("burst", status)


async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> tuple[dict[str, Any], list[dict]]:
    limits = httpx.Limits(max_connections=args.concurrency * 8 + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as client:
        traffic = Traffic(client, random.Random(args.seed))
        baseline = await scrape(client)
        samples: list[dict[str, float | None]] = []
        bursts: list[asyncio.Task] = []
        start = time.monotonic()
        end = start + args.minutes * 60

        async def worker() -> None:
            while time.monotonic() < end:
                await traffic.one()

        async def sampler() -> None:
            next_burst = start + args.burst_every
            while time.monotonic() < end:
                metrics = await scrape(client)
                samples.append({"t": round(time.monotonic() - start, 1), "rss_mb": rss_mb(pid), **metrics})
                if time.monotonic() >= next_burst:
                    next_burst += args.burst_every
                    bursts.append(asyncio.create_task(traffic.burst(args.concurrency * 4)))
                await asyncio.sleep(args.sample_every)

        await asyncio.gather(sampler(), *(worker() for _ in range(args.concurrency)))
        await asyncio.gather(*bursts)
        settled = await wait_idle(client, baseline["kv_cache_usage_perc"])
        final = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
        samples.append({"t": round(time.monotonic() - start, 1), "rss_mb": rss_mb(pid), **settled})
    return report(args, traffic, samples, baseline, settled, final.status_code), samples


async def wait_idle(client: httpx.AsyncClient, kv_baseline: float, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(client)
        idle = (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
                and abs(m["kv_cache_usage_perc"] - kv_baseline) < 1e-9)
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


def _figures(samples: list[dict], key: str, warmup_s: float) -> dict[str, float | None]:
    values = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not values:
        return {"first": None, "start": None, "end": None, "max": None}
    after = [v for t, v in values if t >= warmup_s] or [values[-1][1]]
    return {"first": values[0][1], "start": after[0], "end": values[-1][1], "max": max(v for _, v in values)}


def report(args: argparse.Namespace, traffic: Traffic, samples: list[dict], baseline: dict[str, float],
           settled: dict[str, float], final_status: int) -> dict[str, Any]:
    idle = (settled["num_requests_running"] == 0 and settled["num_requests_waiting"] == 0
            and abs(settled["kv_cache_usage_perc"] - baseline["kv_cache_usage_perc"]) < 1e-9)
    return {"minutes": args.minutes, "concurrency": args.concurrency, "requests": sum(traffic.outcomes.values()),
            "outcomes": dict(sorted(traffic.outcomes.items())), "anomalies": traffic.anomalies[:50],
            "num_anomalies": len(traffic.anomalies), "rss_mb": _figures(samples, "rss_mb", args.warmup_s),
            "kv_cache_usage": _figures(samples, "kv_cache_usage_perc", args.warmup_s),
            "idle_at_end": idle, "final_request_status": final_status,
            "ok": idle and final_status == 200 and not traffic.anomalies}


def main() -> int:
    args = parse_args()
    server = None
    if args.url is None:
        server = ServerProcess("--model", "tiny-random", "--device", "cpu", "--max-model-len", "512",
                               "--max-num-seqs", "8", "--max-queue-len", "16").wait_ready()
        base_url, pid = server.base_url, server.proc.pid
    else:
        base_url, pid = args.url, args.pid
    try:
        result, samples = asyncio.run(soak(args, base_url, pid))
    finally:
        if server is not None:
            print(f"server exit status {server.stop()}", file=sys.stderr)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "samples": samples}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
