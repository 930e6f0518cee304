"""Benchmarks: workloads, the bandwidth-floor arithmetic, `bench throughput` on the tiny model and
`bench serve` against a live server subprocess."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from server.bench import serve as bench_serve
from server.bench import throughput as bench_throughput
from server.bench.common import (
    NANO_MAX_LEN,
    NANO_MIN_LEN,
    Workload,
    device_bandwidth,
    make_workload,
    percentiles,
    simulate_floor,
)

REPO = Path(__file__).resolve().parents[1]
PHASE_FIELDS = ("schedule", "prepare", "forward", "sample", "postprocess")


# ------------------------------------------------------------------------------------------ workload
def test_nano_workload_shape_and_determinism():
    w = make_workload("nano", vocab_size=500, seed=3)
    assert len(w.prompts) == len(w.output_lens) == 256
    lens = np.array(w.prompt_lens + w.output_lens)
    assert lens.min() >= NANO_MIN_LEN and lens.max() <= NANO_MAX_LEN
    assert len(set(w.prompt_lens)) > 100          # lengths vary, not one fixed value
    ids = np.concatenate([np.array(p) for p in w.prompts])
    assert ids.min() >= 0 and ids.max() < 500
    assert make_workload("nano", 500, seed=3) == w
    assert make_workload("nano", 500, seed=4).prompt_lens != w.prompt_lens


def test_random_workload_and_bad_input():
    w = make_workload("random", 100, seed=0, num_prompts=5, input_len=7, output_len=3)
    assert w.prompt_lens == [7] * 5 and w.output_lens == [3] * 5 and w.max_total_len == 10
    with pytest.raises(ValueError, match="workload"):
        make_workload("bogus", 100, 0)
    with pytest.raises(ValueError, match="num-prompts"):
        make_workload("random", 100, 0, num_prompts=0)


# ------------------------------------------------------------------------------------------ floor
def test_floor_hand_computed():
    # One slot: request A (prompt 2, 3 outputs) decodes twice over 3 then 4 KV tokens; then B (prompt 3,
    # 2 outputs) once over 4 tokens. 3 steps x 100 weight bytes + (3 + 4 + 4) KV bytes = 311.
    one = simulate_floor([2, 3], [3, 2], max_num_seqs=1, weight_bytes=100, kv_bytes_per_token=1, bandwidth=10.0)
    assert (one.decode_steps, one.bytes_read, one.output_tokens) == (3, 311, 5)
    assert one.seconds == pytest.approx(31.1)
    assert one.output_tok_per_s == pytest.approx(5 / 31.1)
    # Two slots: the first step reads the weights once for both (3 + 4 KV), then A alone (4): 211.
    two = simulate_floor([2, 3], [3, 2], max_num_seqs=2, weight_bytes=100, kv_bytes_per_token=1, bandwidth=10.0)
    assert (two.decode_steps, two.bytes_read) == (2, 211)
    # A single output token comes from the prefill: no decode step at all.
    assert simulate_floor([5, 5], [1, 1], 1, 100, 1, 1.0).bytes_read == 0


def _floor_step_by_step(prompt_lens, output_lens, max_num_seqs, weight_bytes, kv_bytes):
    """The same model, one decode step at a time: an independent check of the closed form."""
    waiting = list(zip(prompt_lens, output_lens))
    running: list[list[int]] = []      # [context tokens at next decode, decode steps left]
    total = steps = 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            p, o = waiting.pop(0)
            if o > 1:
                running.append([p + 1, o - 1])
        if not running:
            continue
        total += weight_bytes + kv_bytes * sum(c for c, _ in running)
        steps += 1
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return total, steps


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_floor_matches_step_by_step_simulation(max_num_seqs):
    rng = np.random.default_rng(max_num_seqs)
    prompts, outputs = rng.integers(1, 40, 20).tolist(), rng.integers(1, 30, 20).tolist()
    floor = simulate_floor(prompts, outputs, max_num_seqs, weight_bytes=1000, kv_bytes_per_token=7, bandwidth=1.0)
    assert (floor.bytes_read, floor.decode_steps) == _floor_step_by_step(prompts, outputs, max_num_seqs, 1000, 7)


def test_bandwidth_table():
    assert device_bandwidth("NVIDIA H100 80GB HBM3") == 3.0e12
    assert device_bandwidth("NVIDIA H200") == 4.0e12
    assert device_bandwidth("NVIDIA A100-SXM4-80GB") == 1.6e12
    assert device_bandwidth("cpu") is None and device_bandwidth(None) is None


def test_percentiles():
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["mean"] == 2.5 and p["p50"] == 2.5 and p["p50"] <= p["p90"] <= p["p99"] <= 4.0
    assert all(math.isnan(v) for v in percentiles([]).values())


# ------------------------------------------------------------------------------------------ throughput
@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model="tiny-random", device="cpu", max_num_seqs=4, max_model_len=64,
                                  max_num_batched_tokens=64))


def test_throughput_run_counts_every_token(engine):
    prompts = make_workload("random", engine.vocab_size, 1, num_prompts=6, input_len=5).prompts
    prompts[2] = prompts[2] * 9    # a 45-token prompt: prefilled in chunks next to decodes
    workload = Workload(prompts, [3, 9, 1, 6, 12, 4])
    result = bench_throughput.run(engine, workload, temperature=0.0, record_timings=True)
    assert result.output_tokens == sum(workload.output_lens)
    assert result.prompt_tokens == sum(workload.prompt_lens) and result.num_requests == 6
    assert result.elapsed_s > 0 and result.output_tok_per_s > 0
    assert result.total_tok_per_s > result.output_tok_per_s
    timings = engine.step_timings
    assert 0 < len(timings) <= result.num_steps
    assert max(t.num_seqs for t in timings) <= 4       # max_num_seqs holds
    assert all(t.forward > 0 and min(getattr(t, f) for f in PHASE_FIELDS) >= 0 for t in timings)
    assert not engine.record_timings                     # left off after the run
    summary = bench_throughput.summarize_step_timings(timings)
    assert summary["steps"] == len(timings)
    assert summary["forward"] == pytest.approx(1e3 * sum(t.forward for t in timings) / len(timings))
    assert summary["host"] == pytest.approx(sum(summary[f] for f in PHASE_FIELDS if f != "forward"))
    assert bench_throughput.summarize_step_timings(timings, min_seqs=5) == {"steps": 0.0}


def test_weight_and_kv_bytes(engine):
    model = engine.model
    embed = model.embed_tokens.weight
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = every if model.lm_head.weight is embed else every - embed.numel() * embed.element_size()
    assert bench_throughput.weight_bytes_per_step(model) == expected
    cfg = model.config
    itemsize = engine.config.torch_dtype.itemsize   # --dtype auto: bf16 on CPUs where it is faster, else fp32
    assert bench_throughput.kv_bytes_per_token(engine) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def test_bench_throughput_cli(tmp_path, capsys):
    out = tmp_path / "tp.json"
    args = bench_throughput.build_parser().parse_args([
        "--device", "cpu", "--workload", "random", "--num-prompts", "5", "--input-len", "12", "--output-len", "6",
        "--max-num-seqs", "4", "--bandwidth", "1e10", "--json-out", str(out)])
    assert bench_throughput.main(args) == 0
    data = json.loads(out.read_text())
    assert data["output_tokens"] == 5 * 6 and data["prompt_tokens"] == 5 * 12
    assert data["output_tok_per_s"] == pytest.approx(data["output_tokens"] / data["elapsed_s"])
    assert 0 < data["step_ms"]["steps"] <= data["num_steps"] and data["step_ms"]["forward"] > 0
    assert data["timed_run"]["output_tokens"] == data["output_tokens"]   # the timing pass: same workload
    floor = data["floor"]
    assert floor["output_tokens"] == 30 and floor["decode_steps"] > 0 and floor["bandwidth"] == 1e10
    assert floor["percent_of_floor"] == pytest.approx(100 * data["output_tok_per_s"] / floor["output_tok_per_s"])
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "bandwidth floor" in printed


def test_bench_throughput_rejects_oversized_requests(capsys):
    args = bench_throughput.build_parser().parse_args([
        "--device", "cpu", "--workload", "random", "--num-prompts", "1", "--input-len", "60", "--output-len", "10",
        "--max-model-len", "32"])
    assert bench_throughput.main(args) == 2
    assert "error" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ serve
def test_arrival_delays_and_sse_parsing():
    assert not bench_serve.arrival_delays(4, math.inf, 0).any()
    gaps = bench_serve.arrival_delays(4000, 50.0, 0)
    assert gaps.min() >= 0 and gaps.mean() == pytest.approx(1 / 50, rel=0.1)
    with pytest.raises(ValueError):
        bench_serve.arrival_delays(3, 0.0, 0)
    assert bench_serve.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert bench_serve.parse_sse_line("data: [DONE]") is None and bench_serve.parse_sse_line(": ping") is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    if not (REPO / "server" / "cli.py").is_file():
        pytest.skip("server/cli.py does not exist yet")
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "server", "serve", "--model", "tiny-random", "--port", str(port), "--device", "cpu",
           "--max-model-len", "96", "--max-num-seqs", "8", "--log-level", "warning", "--no-access-log"]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_against_live_server(live_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    args = bench_serve.build_parser().parse_args([
        "--base-url", live_server, "--num-prompts", "6", "--input-len", "10", "--output-len", "5",
        "--request-rate", "50", "--max-concurrency", "4", "--json-out", str(out)])
    assert bench_serve.main(args) == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["failed"] == 0
    assert data["output_tokens"] == 6 * 5
    ttft, itl, e2e = data["ttft_ms"], data["itl_ms"], data["e2e_ms"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert itl["mean"] > 0 and e2e["p50"] >= ttft["p50"]
    assert data["output_tok_per_s"] == pytest.approx(30 / data["duration_s"])
    assert "TTFT" in capsys.readouterr().out


def test_bench_serve_refuses_requests_longer_than_the_server_allows(live_server, capsys):
    args = bench_serve.build_parser().parse_args([
        "--base-url", live_server, "--num-prompts", "2", "--input-len", "90", "--output-len", "10"])
    assert bench_serve.main(args) == 2
    assert "max_model_len" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ vs transformers
def test_vs_transformers_smoke(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("vs_transformers", REPO / "benchmarks" / "vs_transformers.py")
    vs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, vs)     # its dataclasses look their module up by name
    spec.loader.exec_module(vs)
    out = tmp_path / "vs.json"
    assert vs.main(["--device", "cpu", "--workload", "random", "--num-prompts", "4", "--input-len", "12",
                    "--output-len", "5", "--max-num-seqs", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for side in ("pagedserve", "transformers"):
        assert data[side]["output_tokens"] == data["output_tokens"] == 4 * 5
        assert data[side]["elapsed_s"] > 0
    ours, theirs = data["pagedserve"]["output_tok_per_s"], data["transformers"]["output_tok_per_s"]
    assert data["ratio"] == pytest.approx(ours / theirs)
    assert data["transformers_kv_cache_tokens"] >= data["kv_cache_tokens"]
