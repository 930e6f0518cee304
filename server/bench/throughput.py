"""`pagedserve bench throughput`: offline throughput of LLMEngine on a synthetic workload (no HTTP).

Adds every request at once and steps the engine until it drains (as nano-vllm's bench does), after a
short warm-up so that one-time costs (allocator growth, kernel compilation, graph capture) are not
counted. Reports output and total tok/s, the engine's per-step phase times, and how close the run came
to the memory-bandwidth floor of the workload on this GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from engine import device_info
from engine.device_info import weight_bytes_per_step
from server.bench.common import (
    WORKLOADS,
    BandwidthFloor,
    Workload,
    device_bandwidth,
    fresh_prompts,
    make_workload,
    resolve_bench_model,
    simulate_floor,
    write_json,
)
from server.settings import add_option_arguments

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")
BUSY_STEP_SEQS = 64     # "busy" steps: the regime where host overhead per step matters most


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_workload_arguments(parser)
    out = parser.add_argument_group("report")
    out.add_argument("--bandwidth", type=float, default=None,
                     help="memory bandwidth in bytes/s for the floor (default: table by GPU name; none on CPU)")
    out.add_argument("--step-timings", default=True, action=argparse.BooleanOptionalAction,
                     help="run the workload a second time with per-step phase timings on")
    out.add_argument("--json-out", default=None, metavar="FILE")


ENGINE_OPTIONS = ("model", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                  "max_model_len", "gpu_memory_utilization", "enforce_eager", "attention_backend", "async_scheduling",
                  "tensor_parallel_size")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags of `pagedserve serve` (one options table, server/settings.py), with defaults sized
    for a throughput run."""
    engine = parser.add_argument_group("engine")
    add_option_arguments(engine, ENGINE_OPTIONS, defaults={
        "model": "tiny-random", "max_num_seqs": 256, "max_num_batched_tokens": 8192}, helps={
        "model": "checkpoint dir, .gguf file, 'tiny-random', or a shape name (qwen3-0.6b, llama-3.2-1b): a "
                 "random-weight bf16 checkpoint of that shape, built once into the cache dir",
        "max_model_len": "default: the workload's longest prompt + output"})


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", default="nano", choices=WORKLOADS,
                      help="nano: 256 requests, prompt/output lengths uniform in [100, 1024]; "
                           "random: --num-prompts x fixed --input-len/--output-len")
    work.add_argument("--num-prompts", type=int, default=None, help="default: 256 (nano) or 100 (random)")
    work.add_argument("--input-len", type=int, default=1024)
    work.add_argument("--output-len", type=int, default=128)
    work.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (nano-vllm uses 0.6)")
    work.add_argument("--seed", type=int, default=0)


# ------------------------------------------------------------------------------------------ the run
@dataclass
class ThroughputResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    num_steps: int           # engine.step() calls
    num_preemptions: int

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s


def engine_config(args: argparse.Namespace, workload: Workload):
    from engine.config import EngineConfig

    return EngineConfig(
        model=resolve_bench_model(args.model), device=args.device, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len or workload.max_total_len, attention_backend=args.attention_backend,
        seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling)


def model_vocab_size(model: str) -> int:
    """The vocabulary the prompts are drawn from, read from the model's config before the engine loads."""
    from engine.default_model import resolve_model
    from engine.loader import load_model_config

    return load_model_config(resolve_model(model)).vocab_size


def run_requests(engine, workload: Workload, temperature: float, prefix: str) -> tuple[int, int]:
    """Adds every request, steps until all finish; returns (output tokens, step() calls)."""
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"{prefix}-{i}", prompt, _params(out_len, temperature))
    tokens = steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += sum(len(s.new_token_ids) for s in delta.seqs)
            if delta.error:
                raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
        steps += 1
    return tokens, steps


def warm_up(engine, temperature: float) -> None:
    """A short generate at a few batch sizes, so one-time costs stay out of the measurement."""
    output_len = max(1, min(8, engine.max_model_len // 3))       # small, and fits any max_model_len
    input_len = max(1, min(16, engine.max_model_len - output_len))
    for batch in sorted({1, min(8, engine.config.max_num_seqs)}):
        warm = make_workload("random", engine.vocab_size, 12345 + batch, batch, input_len, output_len)
        run_requests(engine, warm, temperature, f"warmup{batch}")


def sync(engine) -> None:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def run(engine, workload: Workload, temperature: float, record_timings: bool = False,
        prefix: str = "bench") -> ThroughputResult:
    """One timed pass over the workload. With record_timings the engine fills engine.step_timings, at
    the price of a device sync per forward (which also stalls the host/device overlap), so the
    headline throughput comes from a pass without it."""
    preempt0 = engine.stats().num_preemptions_total
    engine.step_timings.clear()
    engine.record_timings = record_timings
    sync(engine)
    start = time.perf_counter()
    try:
        tokens, steps = run_requests(engine, workload, temperature, prefix)
        sync(engine)
    finally:
        engine.record_timings = False
    elapsed = time.perf_counter() - start
    return ThroughputResult(len(workload.prompts), workload.num_prompt_tokens, tokens, elapsed, steps,
                            engine.stats().num_preemptions_total - preempt0)


# ------------------------------------------------------------------------------------------ analysis
def summarize_step_timings(timings: list, min_seqs: int = 0) -> dict[str, float]:
    """Mean milliseconds per step of each recorded phase over steps with >= min_seqs sequences, plus
    "host": the engine's own host-overhead sum (StepTiming.host: schedule + prepare, which includes the
    sampler's host-side prepare, + sample + postprocess), i.e. all but the forward."""
    chosen = [t for t in timings if t.num_seqs >= min_seqs]
    summary: dict[str, float] = {"steps": float(len(chosen))}
    if not chosen:
        return summary
    for name in phase_names(chosen[0]):
        summary[name] = 1e3 * sum(getattr(t, name) for t in chosen) / len(chosen)
    summary["host"] = 1e3 * sum(_host_seconds(t) for t in chosen) / len(chosen)
    summary["mean_seqs"] = sum(t.num_seqs for t in chosen) / len(chosen)
    summary["mean_tokens"] = sum(t.num_tokens for t in chosen) / len(chosen)
    return summary


def phase_names(timing) -> list[str]:
    """The timed phases of a StepTiming, in declaration order (PHASES first, then any the engine adds)."""
    names = [f.name for f in fields(timing) if f.name not in ("num_seqs", "num_tokens")]
    return [p for p in PHASES if p in names] + [n for n in names if n not in PHASES]


def _host_seconds(timing) -> float:
    host = getattr(timing, "host", None)
    return host if host is not None else sum(getattr(timing, p) for p in PHASES if p != "forward")


def kv_bytes_per_token(engine) -> int:
    return device_info.kv_bytes_per_token(engine.model, engine.runner.kv_cache.dtype)


def device_name(engine) -> str:
    return device_info.device_name(engine.device)


def bandwidth_floor(engine, workload: Workload, bandwidth: float | None) -> BandwidthFloor | None:
    if bandwidth is None and engine.device.type == "cuda":
        bandwidth = device_bandwidth(device_name(engine))
    if bandwidth is None:
        return None
    return simulate_floor(workload.prompt_lens, workload.output_lens, engine.config.max_num_seqs,
                          weight_bytes_per_step(engine.model), kv_bytes_per_token(engine), bandwidth)


# ------------------------------------------------------------------------------------------ report
def report(engine, result: ThroughputResult, timed: ThroughputResult | None, floor: BandwidthFloor | None,
           model: str) -> dict[str, Any]:
    """`result`: the clean pass; `timed`: the pass that recorded engine.step_timings (None: skipped)."""
    cfg = engine.config
    data: dict[str, Any] = {
        "model": model, "device": device_name(engine), "dtype": cfg.dtype,
        "attention_backend": cfg.attention_backend, "enforce_eager": cfg.enforce_eager,
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "num_kv_blocks": engine.num_kv_blocks, "block_size": cfg.block_size,
        **asdict(result), "output_tok_per_s": result.output_tok_per_s, "total_tok_per_s": result.total_tok_per_s,
    }
    if timed is not None:
        data["timed_run"] = {"elapsed_s": timed.elapsed_s, "output_tokens": timed.output_tokens,
                             "output_tok_per_s": timed.output_tok_per_s}
        data["step_ms"] = summarize_step_timings(engine.step_timings)
        data[f"step_ms_seqs_ge_{BUSY_STEP_SEQS}"] = summarize_step_timings(engine.step_timings, BUSY_STEP_SEQS)
    if floor is not None:
        data["floor"] = {**asdict(floor), "output_tok_per_s": floor.output_tok_per_s,
                         "percent_of_floor": 100.0 * result.output_tok_per_s / floor.output_tok_per_s}
    return data


def print_report(data: dict[str, Any]) -> None:
    print(f"model {data['model']} on {data['device']} ({data['dtype']}, attention={data['attention_backend']}, "
          f"eager={data['enforce_eager']}, max_num_seqs={data['max_num_seqs']}, kv_blocks={data['num_kv_blocks']})")
    rows = [("requests", f"{data['num_requests']}"), ("prompt tokens", f"{data['prompt_tokens']}"),
            ("output tokens", f"{data['output_tokens']}"), ("wall time", f"{data['elapsed_s']:.2f} s"),
            ("engine steps", f"{data['num_steps']}"), ("preemptions", f"{data['num_preemptions']}"),
            ("output tok/s", f"{data['output_tok_per_s']:.1f}"), ("total tok/s", f"{data['total_tok_per_s']:.1f}")]
    for name, value in rows:
        print(f"  {name:<16}{value:>14}")
    if "step_ms" in data:
        print_step_table(data)
    floor = data.get("floor")
    if floor is None:
        print("  bandwidth floor: skipped (no known GPU; pass --bandwidth BYTES_PER_S)")
    else:
        print(f"  bandwidth floor: {floor['bytes_read'] / 1e9:.4g} GB over {floor['decode_steps']} decode steps at "
              f"{floor['bandwidth'] / 1e12:.3g} TB/s = {floor['seconds']:.4g} s -> "
              f"{floor['output_tok_per_s']:.1f} output tok/s; this run: {floor['percent_of_floor']:.1f}% of it")


def print_step_table(data: dict[str, Any]) -> None:
    timed = data["timed_run"]
    print(f"  per-step timings from a second pass with timing on ({timed['output_tok_per_s']:.1f} output tok/s, "
          f"{timed['elapsed_s']:.2f} s):")
    phases = [k for k in data["step_ms"] if k not in ("steps", "host", "mean_seqs", "mean_tokens")] or list(PHASES)
    print("  mean ms per step   " + "".join(f"{p:>12}" for p in (*phases, "host", "steps")))
    for label, key in (("all steps", "step_ms"), (f">= {BUSY_STEP_SEQS} seqs", f"step_ms_seqs_ge_{BUSY_STEP_SEQS}")):
        s = data[key]
        cells = "".join(f"{s[p]:>12.3f}" if p in s else f"{'-':>12}" for p in (*phases, "host"))
        print(f"  {label:<19}{cells}{int(s['steps']):>12}")


def main(args: argparse.Namespace) -> int:
    from engine.engine import LLMEngine

    try:
        model = resolve_bench_model(args.model)
        workload = make_workload(args.workload, model_vocab_size(model), args.seed, args.num_prompts,
                                 args.input_len, args.output_len)
        engine = LLMEngine(engine_config(args, workload))
        for prompt, out_len in zip(workload.prompts, workload.output_lens):   # fail before the clock starts
            engine.check_request(prompt, _params(out_len, args.temperature))
    except ValueError as exc:
        hint = ""
        if args.max_model_len is None and "max_model_len" in str(exc):
            hint = (" (--max-model-len defaults to the workload's longest prompt + output: choose a shorter "
                    "workload, e.g. --workload random --input-len/--output-len, or a model with a longer context)")
        print(f"pagedserve bench throughput: error: {exc}{hint}", file=sys.stderr)
        return 2
    warm_up(engine, args.temperature)
    result = run(engine, workload, args.temperature)
    timed = None
    if args.step_timings:   # same lengths, fresh prompt ids: the prefix cache must not serve the rerun
        rerun = fresh_prompts(workload, engine.vocab_size, args.seed + 1)
        timed = run(engine, rerun, args.temperature, record_timings=True, prefix="timed")
    data = report(engine, result, timed, bandwidth_floor(engine, workload, args.bandwidth), args.model)
    print_report(data)
    write_json(args.json_out, data)
    return 0


def _params(out_len: int, temperature: float):
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=temperature)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench throughput", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
