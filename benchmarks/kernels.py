"""Kernel benchmarks on one GPU: paged decode bandwidth and prefill speed, next to torch SDPA.

    python benchmarks/kernels.py --out DIR            # full table -> DIR/kernels.json, DIR/kernels.md
    python benchmarks/kernels.py --out DIR --sweep    # also try tile / warp / stage configs, report the best
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python benchmarks/kernels.py --sanitize        # one decode + one prefill launch, for memcheck

Decode: achieved bandwidth = KV bytes the step must read (batch x context x 2 x kv_heads x head_dim x 2 B)
/ median time (triton.testing.do_bench). SDPA runs on the same K/V gathered contiguous beforehand (untimed).
Prefill: one fresh prompt of T tokens through the paged cache vs SDPA's flash backend on contiguous q/k/v.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.paged_attention import choose_num_splits, decode_workspace, paged_decode_attention, paged_prefill_attention  # noqa: E402

SHAPES = [(16, 8, 128), (32, 8, 64)]  # (q heads, kv heads, head_dim): Qwen3-0.6B-like, Llama-3.2-1B-like
BATCHES, CONTEXTS, PREFILL_LENS = [1, 8, 64, 256], [512, 1024, 4096], [1024, 2048, 4096]
BLOCK_SIZE = 16
DECODE_SWEEP = [dict(tile=t, num_warps=w, num_stages=s) for t in (16, 32, 64) for w in (2, 4, 8) for s in (2, 3, 4)]
PREFILL_SWEEP = [dict(block_m=m, tile=t, num_warps=w, num_stages=s)
                 for m in (64, 128) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def _paged(batch: int, ctx: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16):
    """Random paged K/V for `batch` sequences of `ctx` tokens, blocks shuffled over the cache."""
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = 1 + batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, seq_lens


def _gather(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[batch, kv_heads, ctx, head_dim] contiguous copy for SDPA."""
    return cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw):
    """SDPA over the KV heads as stored (enable_gqa), so it reads the same bytes; if the selected backend
    has no GQA support, K/V are expanded to the query heads once, untimed."""
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)


def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, return_mode="median")  # ms


def _sweep(run, configs: list[dict]) -> tuple[float, dict]:
    """Fastest config; configs that fail to compile or launch (e.g. too much shared memory) are skipped."""
    timed = []
    for cfg in configs:
        try:
            timed.append((_bench(lambda: run(**cfg)), cfg))
        except Exception as exc:  # noqa: BLE001 - a sweep point that does not fit this GPU
            print(f"skip {cfg}: {type(exc).__name__}", file=sys.stderr)
    return min(timed, key=lambda t: t[0])


def bench_decode(hq: int, hkv: int, d: int, batch: int, ctx: int, sweep: bool, num_sms: int) -> dict:
    k_cache, v_cache, tables, seq_lens = _paged(batch, ctx, hkv, d)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    splits = choose_num_splits(batch, hkv, num_sms)
    out, ws = torch.empty_like(q), decode_workspace(batch * splits, hq, d, "cuda")
    scale = d ** -0.5

    def run(**cfg):
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, splits, out, ws, **cfg)

    kv_bytes = batch * ctx * 2 * hkv * d * 2
    row = dict(kind="decode", q_heads=hq, kv_heads=hkv, head_dim=d, batch=batch, ctx=ctx, splits=splits,
               kv_bytes=kv_bytes, ms=_bench(run))
    if sweep and batch >= 64 and ctx >= 1024:  # the bandwidth-bound regime the targets are about
        row["best_ms"], row["best_config"] = _sweep(run, DECODE_SWEEP)
    sdpa = _sdpa(q[:, :, None, :], _gather(k_cache, tables, ctx), _gather(v_cache, tables, ctx), scale=scale)
    row["sdpa_ms"] = _bench(sdpa)
    ref = sdpa()[:, :, 0]
    row["max_abs_diff_vs_sdpa"] = (run().float() - ref.float()).abs().max().item()
    for key in ("ms", "sdpa_ms", "best_ms"):
        if key in row:
            row[key.replace("ms", "tbps")] = kv_bytes / (row[key] * 1e-3) / 1e12
    return row


def bench_prefill(hq: int, hkv: int, d: int, tokens: int, sweep: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    k_cache, v_cache, tables, seq_lens = _paged(1, tokens, hkv, d)
    q = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    out, scale = torch.empty_like(q), d ** -0.5

    def run(**cfg):
        return paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, tokens, scale, out, **cfg)

    flops = 4 * hq * d * tokens * (tokens + 1) / 2  # causal: QK^T and PV over the visible half
    row = dict(kind="prefill", q_heads=hq, kv_heads=hkv, head_dim=d, tokens=tokens, ms=_bench(run))
    if sweep:
        row["best_ms"], row["best_config"] = _sweep(run, PREFILL_SWEEP)
    q4 = q.transpose(0, 1)[None].contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = _sdpa(q4, _gather(k_cache, tables, tokens), _gather(v_cache, tables, tokens), is_causal=True,
                     scale=scale)
        row["sdpa_flash_ms"] = _bench(sdpa)
        ref = sdpa()[0].transpose(0, 1)
    row["max_abs_diff_vs_sdpa"] = (run().float() - ref.float()).abs().max().item()
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    row["sdpa_tflops"] = flops / (row["sdpa_flash_ms"] * 1e-3) / 1e12
    row["ratio_vs_sdpa"] = row["ms"] / row["sdpa_flash_ms"]
    return row


def sanitize_launches() -> None:
    """One small decode (split-KV) and one prefill launch, synchronised: the unit compute-sanitizer checks."""
    k_cache, v_cache, tables, _ = _paged(3, 100, 2, 128)
    seq_lens = torch.tensor([1, 17, 100], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, 4)
    cu = torch.tensor([0, 1, 17, 117], dtype=torch.int32, device="cuda")
    paged_prefill_attention(torch.randn(117, 8, 128, device="cuda", dtype=torch.bfloat16), k_cache, v_cache,
                            tables, seq_lens, cu, 100, 0.1)
    torch.cuda.synchronize()
    print("decode + prefill launches finished")


def _markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "## Decode (bf16, KV TB/s = KV bytes / median time)", "",
             "| q/kv heads | d | batch | ctx | splits | ms | TB/s | SDPA ms | SDPA TB/s | best TB/s (config) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "decode"):
        best = f"{r['best_tbps']:.2f} ({r['best_config']})" if "best_tbps" in r else "-"
        lines.append(f"| {r['q_heads']}/{r['kv_heads']} | {r['head_dim']} | {r['batch']} | {r['ctx']} | "
                     f"{r['splits']} | {r['ms']:.4f} | {r['tbps']:.2f} | {r['sdpa_ms']:.4f} | {r['sdpa_tbps']:.2f} "
                     f"| {best} |")
    lines += ["", "## Prefill (bf16, causal, one fresh prompt; SDPA = flash backend on contiguous q/k/v)", "",
              "| q/kv heads | d | tokens | ms | TFLOP/s | SDPA ms | SDPA TFLOP/s | ours / SDPA | best ms (config) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "prefill"):
        best = f"{r['best_ms']:.3f} ({r['best_config']})" if "best_ms" in r else "-"
        lines.append(f"| {r['q_heads']}/{r['kv_heads']} | {r['head_dim']} | {r['tokens']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} | {r['sdpa_flash_ms']:.3f} | {r['sdpa_tflops']:.0f} | "
                     f"{r['ratio_vs_sdpa']:.2f} | {best} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="pagedserve kernel benchmarks (needs a CUDA GPU)")
    parser.add_argument("--out", type=Path, help="directory for kernels.json and kernels.md")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile / num_warps / num_stages")
    parser.add_argument("--sanitize", action="store_true", help="run one decode + one prefill launch and exit")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU.")
    if args.sanitize:
        return sanitize_launches()
    if args.out is None:
        raise SystemExit("--out DIR is required (unless --sanitize).")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton
    header = (f"# pagedserve kernels on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, python {platform.python_version()}")
    rows = []
    for hq, hkv, d in SHAPES:
        for batch in BATCHES:
            for ctx in CONTEXTS:
                rows.append(bench_decode(hq, hkv, d, batch, ctx, args.sweep, props.multi_processor_count))
                print(json.dumps(rows[-1]), flush=True)
        for tokens in PREFILL_LENS:
            rows.append(bench_prefill(hq, hkv, d, tokens, args.sweep))
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps({"device": props.name, "rows": rows}, indent=1))
    (args.out / "kernels.md").write_text(_markdown(rows, header))
    print(_markdown(rows, header))


if __name__ == "__main__":
    main()
