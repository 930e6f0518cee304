"""Speculative decoding (n-gram drafts) against none: one stream on the default model, both over HTTP with the
same client, servers one after the other, --rounds times (alternating, so slow drift hits both alike).

    python benchmarks/spec_decode.py [--model FILE] [--rounds 2] [--repeats 3] [--output-tokens 128]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4}'] [--out results.json]

- Input-grounded: a chat request that holds a passage of benchmarks/data/perplexity.txt (a few hundred
  tokens, a different one per repeat) and asks for it back word for word; greedy, --output-tokens out (EOS
  banned, so both stop at the same length). Time per output token = (last chunk - first chunk) / (tokens - 1).
- Random: a prompt of random English words (--prompt-tokens), and one of random token ids, the same out;
  SmolLM2 tends to loop on such prompts, which the lookup predicts. So also: random words sampled at
  temperature 1 (seeded), where drafts are proposed and mostly rejected: the cost of missing.
- Greedy output must be identical with and without speculation (checked: "same_text").
- The acceptance counters of the speculating server (/metrics) are reported with each round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import HERE, TEXT, Server, free_port, random_text, stream_once, stream_timed, words_for  # noqa: E402

ASK = "Repeat the following text exactly, word for word, and nothing else:\n\n"


def passages(count: int, words: int) -> list[str]:
    """Consecutive stretches of the text, `words` words each (wrapping around)."""
    vocab = TEXT.read_text().split()
    step = max(1, (len(vocab) - words) // max(1, count))
    return [" ".join((vocab * 2)[i * step:i * step + words]) for i in range(count)]


def stream_chat(client: httpx.Client, model: str, passage: str, max_tokens: int, eos: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": ASK + passage}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "logit_bias": {str(eos): -100}}
    return stream_timed(client, "/v1/chat/completions", body, max_tokens)


def counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("pagedserve_spec_decode_num_") and "per_pos" not in line:
            out[line.split("{")[0].removeprefix("pagedserve_spec_decode_")] = float(line.split()[-1])
    return out


def measure(server: Server, args: argparse.Namespace, eos: int, words: int) -> dict:
    with httpx.Client(base_url=server.url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        stream_chat(client, model, passages(1, 60)[0], 8, eos)                       # warm-up
        grounded = [stream_chat(client, model, p, args.output_tokens, eos)
                    for p in passages(args.repeats, args.passage_words)]
        rand = [stream_once(client, model, random_text(seed, words), args.output_tokens, eos)
                for seed in range(args.repeats)]
        ids = [np.random.default_rng(seed).integers(100, args.vocab_size, args.prompt_tokens).tolist()
               for seed in range(args.repeats)]
        rand_ids = [stream_once(client, model, prompt, args.output_tokens, eos) for prompt in ids]
        sampled = [stream_once(client, model, random_text(seed, words), args.output_tokens, eos, temperature=1.0,
                               seed=seed) for seed in range(args.repeats)]
    return {"grounded_tpot_ms": round(statistics.median(r["tpot_s"] for r in grounded) * 1e3, 2),
            "grounded_tpot_ms_all": [round(r["tpot_s"] * 1e3, 2) for r in grounded],
            "grounded_chunks": [r["chunks"] for r in grounded],
            "random_tpot_ms": round(statistics.median(r["tpot_s"] for r in rand) * 1e3, 2),
            "random_tpot_ms_all": [round(r["tpot_s"] * 1e3, 2) for r in rand],
            "random_ids_tpot_ms": round(statistics.median(r["tpot_s"] for r in rand_ids) * 1e3, 2),
            "random_ids_tpot_ms_all": [round(r["tpot_s"] * 1e3, 2) for r in rand_ids],
            "sampled_tpot_ms": round(statistics.median(r["tpot_s"] for r in sampled) * 1e3, 2),
            "sampled_tpot_ms_all": [round(r["tpot_s"] * 1e3, 2) for r in sampled],
            "texts": [r["text"] for r in grounded], "counters": counters(server.url)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or checkpoint (default: the default model)")
    p.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                     '"prompt_lookup_min": 2}')
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--passage-words", type=int, default=220)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=49152, help="random-id prompts draw ids below this")
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` flags for both, space-separated")
    p.add_argument("--out", default=None, metavar="FILE.json")
    a = p.parse_args()
    model = ["--model", a.model] if a.model else []
    results: dict = {"spec": json.loads(a.spec), "rounds": []}
    for rnd in range(a.rounds):
        row = {}
        for name, extra in (("none", []), ("ngram", ["--speculative-config", a.spec])):
            port = free_port()
            server = Server(f"pagedserve-{name}", [sys.executable, "-P", "-m", "server", "serve", *model, "--port",
                                                   str(port), "--no-access-log", *extra, *a.pagedserve_args.split()],
                            port, env={"PYTHONPATH": str(HERE.parent)})
            try:
                info = httpx.get(server.url + "/tokenizer_info").json()
                eos = httpx.post(server.url + "/tokenize", json={"prompt": info["eos_token"],
                                                                 "add_special_tokens": False}).json()["tokens"][0]
                row[name] = measure(server, a, eos, words_for(server, a.prompt_tokens))
            finally:
                server.stop()
        none, spec = row["none"], row["ngram"]
        summary = {"grounded_speedup": round(none["grounded_tpot_ms"] / spec["grounded_tpot_ms"], 2),
                   "random_ratio": round(spec["random_tpot_ms"] / none["random_tpot_ms"], 3),
                   "random_ids_ratio": round(spec["random_ids_tpot_ms"] / none["random_ids_tpot_ms"], 3),
                   "sampled_ratio": round(spec["sampled_tpot_ms"] / none["sampled_tpot_ms"], 3),
                   "same_text": none["texts"] == spec["texts"]}
        for r in row.values():
            r.pop("texts")
        results["rounds"].append({**row, **summary})
        print(json.dumps(results["rounds"][-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
