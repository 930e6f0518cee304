"""pagedserve vs Hugging Face transformers' continuous batching: same process, device, checkpoint, workload.

    python benchmarks/vs_transformers.py --model qwen3-0.6b --out results/vs_hf.json          # GPU, nano
    python benchmarks/vs_transformers.py --device cpu --workload random --num-prompts 8 \\
        --input-len 32 --output-len 16 --max-num-seqs 4 --out /tmp/vs_hf.json                 # CPU smoke

Both engines get the same limits: max_num_seqs concurrent requests, the same token budget per step
and the same KV-cache capacity in tokens (our engine sizes its cache first; transformers is then given
as many tokens). Each one warms up before the clock starts; our engine runs first and is released
before transformers loads, so neither competes with the other for memory.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):   # run as a script: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.default_model import resolve_model  # noqa: E402
from server.bench import throughput as bt  # noqa: E402
from server.bench.common import Workload, make_workload, resolve_bench_model, write_json  # noqa: E402


@dataclass
class RunResult:
    engine: str
    output_tokens: int
    elapsed_s: float

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bt.add_engine_arguments(parser)      # the same flags as `pagedserve bench throughput`
    bt.add_workload_arguments(parser)
    hf = parser.add_argument_group("transformers")
    hf.add_argument("--hf-attn-implementation", default="sdpa",
                    help="attention transformers loads with (its CB switches to flash attention when available)")
    hf.add_argument("--hf-page-size", type=int, default=256, help="transformers' KV page size (its default)")
    hf.add_argument("--hf-no-auto-flash", action="store_true",
                    help="keep --hf-attn-implementation even when flash attention is available")
    parser.add_argument("--out", default=None, metavar="FILE.json")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ ours
def run_ours(args: argparse.Namespace, workload: Workload):
    from engine.engine import LLMEngine

    engine = LLMEngine(bt.engine_config(args, workload))
    bt.warm_up(engine, args.temperature)
    result = bt.run(engine, workload, args.temperature)
    kv_tokens = (engine.num_kv_blocks - 1) * engine.config.block_size
    info = {"device": bt.device_name(engine), "dtype": engine.config.dtype,
            "attention_backend": engine.config.attention_backend, "enforce_eager": engine.config.enforce_eager,
            "async_scheduling": engine.config.async_scheduling, "kv_cache_tokens": kv_tokens,
            "num_preemptions": result.num_preemptions}
    release(engine)
    return RunResult("pagedserve", result.output_tokens, result.elapsed_s), info


def release(engine) -> None:
    """Drop the engine's device memory (weights, KV cache, graphs) before transformers loads."""
    executor = getattr(engine, "executor", None)
    if executor is not None and hasattr(executor, "shutdown"):
        executor.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ transformers
def hf_manager(model, args: argparse.Namespace, workload: Workload, kv_tokens: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0) \
        if args.temperature > 0 else dict(do_sample=False)
    # eos_token_id=-1: no token ends a request (our ignore_eos), so both generate exactly max_tokens.
    gen = GenerationConfig(max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=0, **sampling)
    cb = ContinuousBatchingConfig(
        page_size=args.hf_page_size, num_blocks=hf_num_pages(workload, args.max_num_seqs, args.hf_page_size, kv_tokens),
        max_batch_tokens=args.max_num_batched_tokens, max_requests_per_batch=args.max_num_seqs,
        auto_switch_to_flash=not args.hf_no_auto_flash, seed=args.seed)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def hf_num_pages(workload: Workload, max_num_seqs: int, page_size: int, kv_tokens: int) -> int:
    """As many KV tokens as our engine had, and never fewer pages than the max_num_seqs longest requests
    need at once: transformers' big pages (256 tokens) would otherwise make it preempt where we did not."""
    pages = sorted((-(-n // page_size) for n in map(sum, zip(workload.prompt_lens, workload.output_lens))),
                   reverse=True)
    return max(-(-kv_tokens // page_size), sum(pages[:max_num_seqs]))


def hf_generate(manager, workload: Workload, prefix: str) -> int:
    """Adds every request, waits for all; returns the number of generated tokens."""
    ids = [manager.add_request(p, request_id=f"{prefix}-{i}", max_new_tokens=n, eos_token_id=-1)
           for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
    pending, tokens = set(ids), 0
    while pending:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped unexpectedly.")
            continue
        if result.is_finished() and result.request_id in pending:
            if result.error is not None:
                raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
            pending.discard(result.request_id)
            tokens += len(result.generated_tokens)
    return tokens


def run_transformers(args: argparse.Namespace, model_dir: str, dtype: torch.dtype, device: str,
                     workload: Workload, kv_tokens: int) -> tuple[RunResult, dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation=args.hf_attn_implementation)
    model = model.to(device).eval()
    manager = hf_manager(model, args, workload, kv_tokens)
    manager.warmup()
    manager.start()
    try:
        warm = make_workload("random", model.config.vocab_size, 12345, min(8, args.max_num_seqs), 16, output_len=8)
        hf_generate(manager, warm, "warmup")
        sync(device)
        start = time.perf_counter()
        tokens = hf_generate(manager, workload, "bench")
        sync(device)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10)
    pages = hf_num_pages(workload, args.max_num_seqs, args.hf_page_size, kv_tokens)
    info = {"attn_implementation": model.config._attn_implementation,
            "transformers_kv_cache_tokens": pages * args.hf_page_size}
    return RunResult("transformers", tokens, elapsed), info


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.model = resolve_bench_model(args.model)
        workload = make_workload(args.workload, bt.model_vocab_size(args.model), args.seed, args.num_prompts,
                                 args.input_len, args.output_len)
        config = bt.engine_config(args, workload).resolved()
    except ValueError as exc:
        print(f"vs_transformers: error: {exc}", file=sys.stderr)
        return 2
    ours, info = run_ours(args, workload)
    theirs, hf_info = run_transformers(args, str(resolve_model(config.model)), config.torch_dtype, config.device,
                                       workload, info["kv_cache_tokens"])
    for r in (ours, theirs):
        if r.output_tokens != workload.num_output_tokens:
            print(f"warning: {r.engine} generated {r.output_tokens} tokens, expected {workload.num_output_tokens}",
                  file=sys.stderr)
    ratio = ours.output_tok_per_s / theirs.output_tok_per_s
    print(f"{workload.num_output_tokens} output tokens from {len(workload.prompts)} requests on {info['device']} "
          f"({config.dtype}), max_num_seqs={args.max_num_seqs}")
    for r in (ours, theirs):
        print(f"  {r.engine:<14}{r.output_tok_per_s:>12.1f} output tok/s  ({r.elapsed_s:.2f} s)")
    print(f"  ratio (pagedserve / transformers): {ratio:.2f}x")
    data = {"model": args.model, "workload": args.workload, "num_prompts": len(workload.prompts),
            "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens,
            "temperature": args.temperature, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, **info, **hf_info,
            "pagedserve": {**asdict(ours), "output_tok_per_s": ours.output_tok_per_s},
            "transformers": {**asdict(theirs), "output_tok_per_s": theirs.output_tok_per_s},
            "ratio": ratio}
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
