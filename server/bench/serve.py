"""`pagedserve bench serve`: latency and throughput of a running server, measured over HTTP.

Sends random token-id prompts to /v1/completions with stream=true and ignore_eos, arriving as a
Poisson process (--request-rate; inf sends them all at once) and/or capped at --max-concurrency in
flight. Per request it records the time to the first token (TTFT), the gaps between later SSE chunks
(ITL; one chunk carries one token for n=1), the time per output token after the first (TPOT) and the
end-to-end latency.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from server.bench.common import Workload, make_workload, percentiles, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token, if the server requires one (default: $OPENAI_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1000,
                        help="prompt token ids are drawn uniformly from [0, vocab-size)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="mean requests per second of Poisson arrivals (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    parser.add_argument("--json-out", default=None, metavar="FILE")


@dataclass
class RequestResult:
    ok: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (undefined for one-token outputs)."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ------------------------------------------------------------------------------------------ client
def completion_payload(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """One `data: {...}` line -> its JSON object; None for comments, blank lines and [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


async def send_request(client, url: str, payload: dict[str, Any]) -> RequestResult:
    result = RequestResult()
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return result
                if event.get("usage"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
                if event.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except Exception as exc:  # any transport failure counts as a failed request, not a crashed bench
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "the stream ended without a token"
    return result


async def model_card(client, base_url: str, model: str | None) -> dict[str, Any]:
    """The served model's card: the named one, or the first of /v1/models."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    card = next((m for m in models if model is None or m.get("id") == model), None)
    if card is None:
        served = ", ".join(str(m.get("id")) for m in models) or "none"
        raise ValueError(f"model {model!r} is not served at {base_url} (served: {served}).")
    return card


def check_fits(card: dict[str, Any], workload: Workload) -> None:
    limit = card.get("max_model_len")
    if limit is not None and workload.max_total_len > limit:
        raise ValueError(f"input + output length {workload.max_total_len} exceeds the server's max_model_len "
                         f"{limit}; lower --input-len or --output-len.")


def arrival_delays(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds to wait before each request: exponential gaps (a Poisson process), zeros for rate inf."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}.")
    if math.isinf(rate):
        return np.zeros(n)
    return np.random.default_rng(seed).exponential(1.0 / rate, n)


async def run_benchmark(base_url: str, model: str | None, workload: Workload, request_rate: float,
                        max_concurrency: int | None, seed: int, api_key: str | None = None,
                        timeout: float = 3600.0) -> tuple[str, list[RequestResult], float]:
    """Runs the workload against the server; returns (model, per-request results, wall seconds)."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    delays = arrival_delays(len(workload.prompts), request_rate, seed)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        card = await model_card(client, base_url, model)
        check_fits(card, workload)
        model = str(card["id"])
        url = f"{base_url}/v1/completions"

        async def one(prompt: list[int], output_len: int) -> RequestResult:
            async with gate:
                return await send_request(client, url, completion_payload(model, prompt, output_len))

        tasks = []
        start = time.perf_counter()
        for delay, prompt, output_len in zip(delays, workload.prompts, workload.output_lens):
            if delay > 0:
                await asyncio.sleep(float(delay))
            tasks.append(asyncio.create_task(one(prompt, output_len)))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return model, list(results), elapsed


# ------------------------------------------------------------------------------------------ report
def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    ms = lambda values: {k: 1e3 * v for k, v in percentiles(values).items()}  # noqa: E731
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": elapsed, "output_tokens": output_tokens,
        "request_throughput": len(ok) / elapsed, "output_tok_per_s": output_tokens / elapsed,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl]),
        "e2e_ms": ms([r.latency for r in ok]),
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"  {'successful requests':<24}{s['completed']:>12}")
    print(f"  {'failed requests':<24}{s['failed']:>12}")
    print(f"  {'duration':<24}{s['duration_s']:>10.2f} s")
    print(f"  {'output tokens':<24}{s['output_tokens']:>12}")
    print(f"  {'request throughput':<24}{s['request_throughput']:>12.2f} req/s")
    print(f"  {'output token throughput':<24}{s['output_tok_per_s']:>12.1f} tok/s")
    print(f"  {'ms':<12}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99")))
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = s[f"{name}_ms"]
        print(f"  {name.upper():<12}" + "".join(f"{row[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99")))
    for error, count in s["errors"].items():
        print(f"  error x{count}: {error}")


def main(args: argparse.Namespace) -> int:
    try:
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
        workload = make_workload("random", args.vocab_size, args.seed, args.num_prompts, args.input_len,
                                 args.output_len)
        model, results, elapsed = asyncio.run(run_benchmark(
            args.base_url, args.model, workload, args.request_rate, args.max_concurrency, args.seed,
            args.api_key, args.timeout))
    except ValueError as exc:
        print(f"pagedserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:    # the server is down or /v1/models failed
        print(f"pagedserve bench serve: cannot query {args.base_url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results, elapsed)
    print(f"model {model} at {args.base_url}: {args.num_prompts} requests of {args.input_len} + {args.output_len} "
          f"tokens, request rate {args.request_rate}, max concurrency {args.max_concurrency}")
    print_summary(summary)
    write_json(args.json_out, {"model": model, "base_url": args.base_url, "num_prompts": args.num_prompts,
                               "input_len": args.input_len, "output_len": args.output_len,
                               "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
                               **summary})
    return 0 if summary["failed"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
