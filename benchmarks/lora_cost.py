"""The cost of LoRA adapters in a batch: batch 64 on the default model with 4 rank-16 adapters (all seven
projections) spread over the requests, against the same batch on the base model alone.

    python benchmarks/lora_cost.py [--model SmolLM2-135M-Instruct] [--rounds 2] [--out /tmp/lora_cost.json]

Offline engine, greedy, ignore_eos: 64 random-token prompts of 64..256 tokens, 128 output tokens each (the
batch64 workload of benchmarks/vs_vllm_cpu.py). Three modes alternate in one process (so that drift of a
shared machine shows up in all): `off`, the base model in an engine without --enable-lora; `base`, the base
model in the LoRA engine; `lora`, the LoRA engine with the adapters spread over the requests. Each run's
output tok/s is printed. The adapters are random (A and B non-zero), written in PEFT's layout.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vs_vllm_cpu import make_prompts  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT adapter directory for the model whose (full) config is cfg, every projection adapted."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
              "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
        "bias": "none", "use_rslora": False}))
    return folder


def timed_run(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    from engine import LLM, LoRARequest, SamplingParams
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_num_seqs=64, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.rank)
    plain = LLM(model=args.model, max_num_seqs=64)
    cfg = llm.engine.model.full_config
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", cfg, args.rank, i)))
                for i in range(args.num_adapters)]
    prompts = make_prompts(1, 64, 64, 256, cfg.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    timed_run(llm, prompts[:8], warm, spread[:8])
    timed_run(plain, prompts[:8], warm, None)
    results: dict[str, list[float]] = {"off": [], "base": [], "lora": []}
    for _ in range(args.rounds):
        for mode, engine, loras in (("off", plain, None), ("base", llm, None), ("lora", llm, spread)):
            results[mode].append(timed_run(engine, prompts, params, loras))
            print(f"{mode}: {results[mode][-1]:.1f} output tok/s", flush=True)
    best = {mode: max(v) for mode, v in results.items()}
    summary = {"model": args.model, "dtype": llm.engine.config.dtype, "adapters": args.num_adapters,
               "rank": args.rank, "runs": results, "best": best, "lora_over_off": best["lora"] / best["off"],
               "lora_over_base": best["lora"] / best["base"]}
    print(f"best of {args.rounds}: LoRA / base without --enable-lora {summary['lora_over_off']:.3f}, "
          f"LoRA / base in the LoRA engine {summary['lora_over_base']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
