"""One stream on a GGUF file: --quantization gguf (blocks computed with) vs none (dequantized at load).

    python benchmarks/gguf_quantized.py                      # the default model (SmolLM2-135M-Instruct Q4_1)
    python benchmarks/gguf_quantized.py --model FILE.gguf --dtypes float32,bfloat16 --repeats 3
    python benchmarks/gguf_quantized.py --crossover      # kernel vs dequantize + GEMM per row count

Each (quantization, dtype) runs in a fresh process, one after the other, greedy with ignore_eos and prefix
caching off: a --prompt-tokens prompt of random token ids, TTFT (a max_tokens=1 request) and time per output
token ((whole request - TTFT) / (--output-tokens - 1)); the best of --repeats. Also the weight bytes held.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def worker(model: str, quantization: str, dtype: str, prompt_tokens: int, output_tokens: int, repeats: int) -> dict:
    import numpy as np

    from engine import LLM, SamplingParams

    llm = LLM(model=model, device="cpu", dtype=dtype, quantization=quantization, max_num_seqs=1,
              max_model_len=prompt_tokens + output_tokens + 16, enable_prefix_caching=False)
    prompt = np.random.default_rng(0).integers(100, llm.engine.vocab_size - 100, prompt_tokens).tolist()
    llm.generate([prompt[:32]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))   # warm-up
    ttft, whole = [], []
    for _ in range(repeats):
        for sink, n in ((ttft, 1), (whole, output_tokens)):
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            sink.append(time.perf_counter() - t)
    info = llm.engine.info
    return {"quantization": quantization, "dtype": dtype, "ttft_ms": round(min(ttft) * 1e3, 1),
            "tpot_ms": round((min(whole) - min(ttft)) / (output_tokens - 1) * 1e3, 2),
            "weight_mb": round(info.model_weight_bytes / 1e6, 1), "weight_format": info.weight_format}


def crossover(model: str) -> None:
    """The first layer's gate_up and down: the blocks kernel against dequantize + torch's GEMM, per input rows
    (what engine/layers/quantized.py's MAX_KERNEL_ROWS is chosen from)."""
    import torch
    import torch.nn.functional as F

    from engine import LLM

    layer = LLM(model=model, device="cpu", dtype="float32", max_model_len=256).engine.model.layers[0]

    def ms(f, n: int) -> float:
        f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e3

    for name, q in (("gate_up", layer.mlp.gate_up_proj.qweight), ("down", layer.mlp.down_proj.qweight)):
        for m in (1, 4, 8, 16, 32, 64, 128):
            x = torch.randn(m, q.in_features)
            n = max(3, 200 // m)
            print(json.dumps({"weight": name, "rows": m, "kernel_ms": round(ms(lambda: q.linear(x, None), n), 3),
                              "dequantize_gemm_ms": round(ms(lambda: F.linear(x, q.dequantize(torch.float32)), n), 3)}),
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--quantizations", default="gguf,none")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--crossover", action="store_true", help="kernel vs dequantize + GEMM per row count instead")
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.crossover:
        crossover(a.model)
        return
    if a.worker:
        print(json.dumps(worker(a.model, *a.worker, a.prompt_tokens, a.output_tokens, a.repeats)))
        return
    for dtype in a.dtypes.split(","):
        for q in a.quantizations.split(","):
            # -P: benchmarks/kernels.py must not shadow the kernels package
            out = subprocess.run([sys.executable, "-P", __file__, "--model", a.model, "--prompt-tokens", str(a.prompt_tokens),
                                  "--output-tokens", str(a.output_tokens), "--repeats", str(a.repeats),
                                  "--worker", q, dtype], capture_output=True, text=True, check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
