"""Shared pieces of the benchmarks: workloads, random-weight model shapes, the bandwidth floor, stats.

Nothing here touches the engine; `bench throughput`, `bench serve` and benchmarks/vs_transformers.py
build on it so that every benchmark draws the same workload from the same seed.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.device_info import HBM_BANDWIDTH, device_bandwidth  # noqa: F401  (the benchmarks' names)

# nano-vllm's benchmark: 256 requests, prompt and output lengths each uniform in [100, 1024].
NANO_NUM_PROMPTS = 256
NANO_MIN_LEN, NANO_MAX_LEN = 100, 1024
WORKLOADS = ("nano", "random")


# ------------------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_total_len(self) -> int:
        return max(p + o for p, o in zip(self.prompt_lens, self.output_lens))


def make_workload(kind: str, vocab_size: int, seed: int, num_prompts: int | None = None,
                  input_len: int = 1024, output_len: int = 128) -> Workload:
    """`nano`: lengths uniform in [100, 1024] (num_prompts defaults to 256); `random`: fixed lengths.
    Prompt ids are uniform over the whole vocabulary: with ignore_eos nothing depends on their meaning."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {kind!r}.")
    if num_prompts is None:
        num_prompts = NANO_NUM_PROMPTS if kind == "nano" else 100
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}.")
    if vocab_size < 1:
        raise ValueError(f"vocab size must be >= 1, got {vocab_size}.")
    rng = np.random.default_rng(seed)
    if kind == "nano":
        prompt_lens = rng.integers(NANO_MIN_LEN, NANO_MAX_LEN, num_prompts, endpoint=True)
        output_lens = rng.integers(NANO_MIN_LEN, NANO_MAX_LEN, num_prompts, endpoint=True)
    else:
        if input_len < 1 or output_len < 1:
            raise ValueError(f"--input-len and --output-len must be >= 1, got {input_len} and {output_len}.")
        prompt_lens = np.full(num_prompts, input_len)
        output_lens = np.full(num_prompts, output_len)
    return Workload(_random_prompts(rng, prompt_lens, vocab_size), output_lens.tolist())


def fresh_prompts(workload: Workload, vocab_size: int, seed: int) -> Workload:
    """The same lengths with new random ids: a rerun that the prefix cache cannot shortcut."""
    rng = np.random.default_rng(seed)
    return Workload(_random_prompts(rng, np.asarray(workload.prompt_lens), vocab_size), list(workload.output_lens))


def _random_prompts(rng: np.random.Generator, prompt_lens: np.ndarray, vocab_size: int) -> list[list[int]]:
    ids = rng.integers(0, vocab_size, int(prompt_lens.sum()))
    return [chunk.tolist() for chunk in np.split(ids, np.cumsum(prompt_lens)[:-1])]


# -------------------------------------------------------------------------------------------- models
def ensure_shape_checkpoint(shape: str) -> Path:
    """A bf16 random-weight checkpoint with the shape of a real model (tiny_model.SHAPES), built once
    into the cache dir. The directory name hashes the shape and the tokenizer, so a changed recipe
    gets a fresh build instead of a stale one."""
    from engine.tiny_model import SHAPES, build_checkpoint, cache_dir, ensure_tokenizer

    spec = dict(SHAPES[shape])
    key = _digest(spec, ensure_tokenizer().name)
    final = cache_dir() / f"{shape}-bf16-{key}"
    if final.is_dir():
        return final
    # Build beside the final dir and rename: a killed build never leaves a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        arch = spec.pop("arch")
        build_checkpoint(tmp, arch, seed=0, dtype="bfloat16", max_shard_bytes=1 << 30, **spec)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # another process won the race: use its copy
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_bench_model(name: str) -> str:
    """A shape name from tiny_model.SHAPES becomes its cached checkpoint; anything else passes through
    (a checkpoint directory or "tiny-random", which the engine resolves)."""
    from engine.tiny_model import SHAPES

    return str(ensure_shape_checkpoint(name)) if name in SHAPES else name


def _digest(*parts: object) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ bandwidth floor
@dataclass
class BandwidthFloor:
    bytes_read: int          # weights + KV read by every decode step of the workload
    decode_steps: int
    seconds: float
    output_tokens: int
    bandwidth: float         # bytes/s assumed

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.inf


def simulate_floor(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int, weight_bytes: int,
                   kv_bytes_per_token: int, bandwidth: float) -> BandwidthFloor:
    """Lower bound on the time of a workload when decode is purely memory bound.

    Requests are admitted FIFO, at most max_num_seqs at a time; a request's prefill is free and
    yields its first token, so a request with output length o runs o - 1 decode steps. Every decode
    step reads all weights once, plus the KV of every running sequence: at its k-th decode step
    (k = 1..o-1) a sequence attends over p + k tokens. Between two finishes the running set is fixed,
    so each such stretch is summed in closed form (an arithmetic series per sequence)."""
    if max_num_seqs < 1 or bandwidth <= 0:
        raise ValueError("max_num_seqs must be >= 1 and bandwidth > 0.")
    if len(prompt_lens) != len(output_lens):
        raise ValueError("prompt_lens and output_lens must have the same length.")
    context = np.asarray(prompt_lens, np.int64) + 1        # KV tokens read at a request's next decode
    remaining = np.asarray(output_lens, np.int64) - 1      # decode steps left
    waiting = list(range(len(prompt_lens)))[::-1]          # stack: pop() gives FIFO order
    running = np.empty(0, np.int64)
    total_bytes, steps = 0, 0
    while waiting or running.size:
        admitted = []
        while waiting and running.size + len(admitted) < max_num_seqs:   # refill free slots
            i = waiting.pop()
            if remaining[i] > 0:                           # o == 1: done at prefill, no decode step
                admitted.append(i)
        running = np.concatenate([running, np.asarray(admitted, np.int64)])
        if not running.size:
            continue
        d = int(remaining[running].min())                  # steps until the next finish
        c = context[running]
        kv_tokens = int(d * c.sum() + running.size * d * (d - 1) // 2)
        total_bytes += d * weight_bytes + kv_tokens * kv_bytes_per_token
        steps += d
        context[running] += d
        remaining[running] -= d
        running = running[remaining[running] > 0]
    return BandwidthFloor(total_bytes, steps, total_bytes / bandwidth, int(sum(output_lens)), bandwidth)


# ------------------------------------------------------------------------------------------ reporting
def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """mean and p50/p90/p99 (NaN for an empty list, so a report never divides by zero)."""
    if not values:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in qs}}
    arr = np.asarray(values, np.float64)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in qs}}


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Strict JSON: NaN and infinities (an empty percentile, rate inf) become null and "inf"."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_finite(data), indent=2, default=str, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
