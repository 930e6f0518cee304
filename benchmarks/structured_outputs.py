"""What a JSON-schema constraint costs: output tokens/s of a batch whose every request is constrained, against
the same batch unconstrained; and how long a typical schema's first compile takes.

    python benchmarks/structured_outputs.py --model SmolLM2-135M-Instruct --device cpu
    python benchmarks/structured_outputs.py --model tiny-random --device cpu      # the host's share is largest

Same workload on both sides: batch-size prompts, n = 1, temperature 1.0 with fixed seeds, exactly max-tokens
output tokens each. The schema's free-text field has a minLength beyond max-tokens, so no constrained output
can end early, and ignore_eos keeps the unconstrained ones going as long. The engine runs offline
(engine.llm.LLM) in this process; the sides alternate for --passes timed passes after a warm-up round (which
also compiles the grammar), and the best pass of each is reported with the per-step phase times.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured import StructuredOutputs  # noqa: E402

# A typical API schema (an issue tracker's ticket), with a long free-text body.
TICKET = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 80},
    "priority": {"enum": ["low", "medium", "high"]},
    "labels": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    "estimate_hours": {"type": "integer", "minimum": 0, "maximum": 1000},
    "assignee": {"type": ["string", "null"]},
    "body": {"type": "string", "minLength": 4096}},
    "required": ["title", "priority", "labels", "estimate_hours", "assignee", "body"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--passes", type=int, default=2)
    return p.parse_args()


def run(llm: LLM, prompts: list[str], spec: StructuredOutputs | None, max_tokens: int) -> dict:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=spec) for i in range(len(prompts))]
    llm.engine.step_timings.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    decode = [t for t in llm.engine.step_timings if t.num_tokens == t.num_seqs]   # decode-only steps
    ms = {k: 1000 * statistics.median(getattr(t, k) for t in decode)
          for k in ("schedule", "prepare", "forward", "sample", "postprocess")} if decode else {}
    if spec is not None:
        for o in outs:   # every output is the schema's prefix: it parses once its body string is closed
            assert o.outputs[0].text.startswith('{"title":'), o.outputs[0].text[:40]
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "decode_step_ms": ms}


def main() -> None:
    args = parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch_size, max_model_len=1024)
    llm.engine.record_timings = True
    spec = StructuredOutputs(json=json.dumps(TICKET))
    t0 = time.perf_counter()
    cache = llm.engine.structured.cache          # the tokenizer's vocabulary scan, once per engine
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.submit(spec).future.result()
    compile_s = time.perf_counter() - t0
    prompts = [f"Ticket {i}: the login page times out when" for i in range(args.batch_size)]
    run(llm, prompts, spec, 8)                   # warm-up
    run(llm, prompts, None, 8)
    best: dict[str, dict] = {}
    for _ in range(args.passes):
        for name, s in (("unconstrained", None), ("json_schema", spec)):
            r = run(llm, prompts, s, args.max_tokens)
            if name not in best or r["tok_s"] > best[name]["tok_s"]:
                best[name] = r
    slower = 1 - best["json_schema"]["tok_s"] / best["unconstrained"]["tok_s"]
    print(json.dumps({"model": args.model, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
                      "tokenizer_info_s": round(info_s, 3), "first_compile_s": round(compile_s, 3),
                      "results": best, "constrained_slower_by": round(slower, 4)}, indent=1))


if __name__ == "__main__":
    main()
