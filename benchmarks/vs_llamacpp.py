"""pagedserve against llama.cpp on the same GGUF file, both over HTTP with the same client, one after the other.

    python benchmarks/vs_llamacpp.py --llama-python /work/venvs/llama/bin/python [--model FILE.gguf]
        [--repeats 3] [--out results.json]

llama.cpp's side is llama-cpp-python's OpenAI server (`pip install "llama-cpp-python[server]"` in its own
virtualenv: `python -m llama_cpp.server --model FILE --n_threads 2`); pagedserve's is `pagedserve serve
--model FILE` with its defaults (--quantization gguf, --dtype auto). Each server runs alone on the machine.

- One stream: a --prompt-tokens prompt (random English words, a new one per repeat so that neither server's
  prefix cache helps), --output-tokens out, greedy, EOS banned with logit_bias; streamed /v1/completions:
  TTFT (request sent -> first token) and time per output token ((last - first) / (tokens - 1)); the median
  of --repeats.
- Accuracy: the perplexity of benchmarks/data/perplexity.txt on the same token ids (pagedserve's /tokenize):
  pagedserve's from /v1/completions with echo, logprobs and max_tokens 0 (over HTTP); llama.cpp's from its
  own logits (`Llama(logits_all=True).eval(ids)`, in its virtualenv), as its server cannot echo prompt
  log-probabilities.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "perplexity.txt"
LLAMA_PPL = """
import json, sys
import numpy as np
from llama_cpp import Llama
ids = json.load(open(sys.argv[2]))
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[3]), logits_all=True, verbose=False)
llm.eval(ids)
logits = np.asarray(llm.scores[:len(ids)], dtype=np.float64)
logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
lp = logits[np.arange(len(ids) - 1), ids[1:]] - logz[:-1]
print(json.dumps({"logprobs": lp.tolist()}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, its output in a temporary log."""

    def __init__(self, name: str, cmd: list[str], port: int, timeout: float = 600.0, env: dict | None = None) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=HERE.parent,
                                     env=None if env is None else {**os.environ, **env})
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - start
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} not ready in {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def random_text(seed: int, words: int) -> str:
    vocab = TEXT.read_text().split()
    return " ".join(np.random.default_rng(seed).choice(vocab, words))


def stream_once(client: httpx.Client, model: str, prompt: str | list[int], max_tokens: int, eos: int,
                **sampling) -> dict:
    """sampling: body fields over greedy (e.g. temperature, seed)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "logit_bias": {str(eos): -100}, **sampling}
    return stream_timed(client, "/v1/completions", body, max_tokens)


def stream_timed(client: httpx.Client, path: str, body: dict, max_tokens: int) -> dict:
    """Streams one request (completions or chat): TTFT, time per output token, chunks and the text."""
    t0 = time.perf_counter()
    stamps, finish, text = [], None, []
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                stamps.append(time.perf_counter())
                text.append(piece)
            finish = choice.get("finish_reason") or finish
    if finish != "length":
        raise RuntimeError(f"stopped with {finish!r} before {max_tokens} tokens")
    return {"ttft_s": stamps[0] - t0, "tpot_s": (stamps[-1] - stamps[0]) / (max_tokens - 1),
            "chunks": len(stamps), "text": "".join(text)}


def prompt_tokens(client: httpx.Client, model: str, prompt: str) -> int:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


def one_stream(server: Server, args: argparse.Namespace, words: int, eos: int) -> dict:
    with httpx.Client(base_url=server.url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        n_prompt = prompt_tokens(client, model, random_text(10_000, words))
        stream_once(client, model, random_text(10_001, words), 8, eos)                    # warm-up
        runs = [stream_once(client, model, random_text(seed, words), args.output_tokens, eos)
                for seed in range(args.repeats)]
    return {"server": server.name, "ready_s": round(server.ready_s, 1), "prompt_tokens": n_prompt,
            "ttft_ms": round(statistics.median(r["ttft_s"] for r in runs) * 1e3, 1),
            "tpot_ms": round(statistics.median(r["tpot_s"] for r in runs) * 1e3, 2),
            "ttft_ms_all": [round(r["ttft_s"] * 1e3, 1) for r in runs],
            "tpot_ms_all": [round(r["tpot_s"] * 1e3, 2) for r in runs]}


def ppl(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def words_for(server: Server, target: int) -> int:
    """Words of random text that make about `target` tokens (pagedserve's /tokenize)."""
    sample = random_text(9_999, 400)
    n = len(httpx.post(server.url + "/tokenize", json={"prompt": sample}).json()["tokens"])
    return max(1, round(400 * target / n))


def weight_bytes(server: Server) -> int:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("pagedserve_model_weight_bytes{"):
            return int(float(line.split()[-1]))
    raise RuntimeError("no pagedserve_model_weight_bytes in /metrics")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    p.add_argument("--llama-python", required=True, help="python of the virtualenv with llama-cpp-python[server]")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` flags, space-separated")
    p.add_argument("--out", default=None, metavar="FILE.json")
    a = p.parse_args()
    if a.model is None:
        from engine.default_model import DEFAULT_MODEL, resolve
        a.model = str(resolve(DEFAULT_MODEL).path)
    results: dict = {"model": a.model, "threads": a.threads, "rows": []}

    port = free_port()
    ours = Server("pagedserve", [sys.executable, "-P", "-m", "server", "serve", "--model", a.model, "--port", str(port),
                                 "--no-access-log", *a.pagedserve_args.split()], port,
                  env={"PYTHONPATH": str(HERE.parent)})     # this checkout's code (-P: not benchmarks/'s)
    try:
        info = httpx.get(ours.url + "/tokenizer_info").json()
        eos = httpx.post(ours.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
                         ).json()["tokens"][0]
        words = words_for(ours, a.prompt_tokens)
        ids = httpx.post(ours.url + "/tokenize", json={"prompt": TEXT.read_text()}).json()["tokens"]
        results["rows"].append(one_stream(ours, a, words, eos))
        model = httpx.get(ours.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(ours.url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
        r.raise_for_status()
        ours_lp = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
        results["rows"][-1]["weight_bytes"] = weight_bytes(ours)
    finally:
        ours.stop()

    port = free_port()
    theirs = Server("llama.cpp", [a.llama_python, "-m", "llama_cpp.server", "--model", a.model, "--n_threads",
                                  str(a.threads), "--n_ctx", "2048", "--port", str(port)], port)
    try:
        results["rows"].append(one_stream(theirs, a, words, eos))
    finally:
        theirs.stop()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    out = subprocess.run([a.llama_python, "-c", LLAMA_PPL, a.model, f.name, str(a.threads)], capture_output=True,
                         text=True, check=True)
    theirs_lp = json.loads(out.stdout.strip().splitlines()[-1])["logprobs"]

    results["perplexity"] = {"tokens": len(ids), "pagedserve": round(ppl(ours_lp), 4),
                             "llama.cpp": round(ppl(theirs_lp), 4),
                             "max_abs_logprob_diff": round(max(abs(x - y) for x, y in zip(ours_lp, theirs_lp)), 4)}
    ours_row, their_row = results["rows"]
    results["ratios"] = {"tpot": round(ours_row["tpot_ms"] / their_row["tpot_ms"], 3),
                         "ttft": round(ours_row["ttft_ms"] / their_row["ttft_ms"], 3),
                         "perplexity": round(results["perplexity"]["pagedserve"] / results["perplexity"]["llama.cpp"], 4)}
    print(json.dumps(results, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
