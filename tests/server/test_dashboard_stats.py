"""The dashboard's arithmetic: PromQL-style quantiles from buckets, the per-second ring, the decode
bandwidth window, and a StatsCollector fed scripted step messages (rates equal counter differences, block
states, timelines with chunks / preemptions / finish reasons, the efficiency gauge on /metrics)."""
from __future__ import annotations

import math
import random
import time
from types import SimpleNamespace

import pytest
from prometheus_client import Histogram

from engine.messages import StepOutput
from engine.model_info import ModelInfo, TokenizerSource
from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta, StepStats
from server.dashboard import collector as collector_module
from server.dashboard.collector import EFFICIENCY_WINDOW_S, DashboardOptions, DecodeWindow, StatsCollector
from server.dashboard.quantiles import Buckets, histogram_quantile, read_registry
from server.dashboard.series import SecondRing, change, rates
from server.metrics import ServerMetrics


def test_quantile_interpolates_inside_the_bucket() -> None:
    b = Buckets((1.0, 2.0, math.inf), (2.0, 4.0, 4.0))
    assert histogram_quantile(0.5, b) == pytest.approx(0.0 + 1.0 * 2 / 2)          # rank 2 in [0, 1]
    assert histogram_quantile(0.75, b) == pytest.approx(1.0 + 1.0 * (3 - 2) / 2)    # rank 3 in (1, 2]
    overflow = Buckets((1.0, math.inf), (1.0, 2.0))
    assert histogram_quantile(0.9, overflow) == 1.0          # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, Buckets((1.0, math.inf), (0.0, 0.0))) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, b)


def test_quantile_of_random_observations_lands_in_the_right_bucket() -> None:
    rng = random.Random(5)
    bounds = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
    metrics = ServerMetrics("m", 64)
    hist = Histogram("x_seconds", "x", buckets=bounds, registry=metrics.registry)
    observations = [rng.expovariate(3.0) for _ in range(500)]
    for v in observations:
        hist.observe(v)
    _, hists = read_registry(metrics.registry)
    buckets = hists["x_seconds"]
    assert buckets.bounds == (*bounds, math.inf) and buckets.total == len(observations)
    for q in (0.1, 0.5, 0.9, 0.99):
        value = histogram_quantile(q, buckets)
        rank = q * len(observations)
        upper = next(b for b in buckets.bounds if sum(o <= b for o in observations) >= rank)
        lower = max([0.0] + [b for b in buckets.bounds if b < upper])
        assert lower <= value <= (upper if math.isfinite(upper) else bounds[-1]), q


def test_ring_fills_gaps_and_keeps_capacity() -> None:
    ring = SecondRing(5)
    ring.record(10, {"c": 1.0})
    ring.record(10, {"c": 2.0})          # the same second: replaced
    ring.record(13, {"c": 7.0})          # 11 and 12 repeat second 10's row
    ring.record(12, {"c": 99.0})         # the past: ignored
    seconds, rows = ring.rows()
    assert seconds == [10, 11, 12, 13] and [r["c"] for r in rows] == [2.0, 2.0, 2.0, 7.0]
    assert rates(rows, "c") == [0.0, 0.0, 5.0] and change(rows, "c") == 5.0
    ring.record(100, {"c": 9.0})         # a long gap: only the last `capacity` seconds remain
    seconds, rows = ring.rows()
    assert seconds == [96, 97, 98, 99, 100] and rows[0]["c"] == 7.0 and len(ring) == 5
    assert ring.rows(2)[0] == [98, 99, 100]


def test_decode_window_averages_recent_steps_only() -> None:
    w = DecodeWindow(10)
    assert w.bytes_per_second(0.0) is None
    w.add(100.2, 1000.0, 0.5)
    w.add(100.7, 3000.0, 0.5)
    w.add(105.0, 600.0, 0.2)
    assert w.bytes_per_second(105.5) == pytest.approx(4600.0 / 1.2)
    assert w.bytes_per_second(112.0) == pytest.approx(600.0 / 0.2)      # second 100 has left the window
    assert w.bytes_per_second(200.0) is None


def _info(bandwidth: float | None) -> ModelInfo:
    return ModelInfo("m", 64, 100, (), num_kv_blocks=33, block_size=4, max_num_seqs=8,
                     tokenizer=TokenizerSource("/nonexistent"), weight_bytes=1000, kv_bytes_per_token=10,
                     memory_bandwidth=bandwidth)


def _step(deltas, *, running=1, used=0, cached=0, step=None) -> StepOutput:
    return StepOutput(deltas, EngineStats(num_running=running, kv_blocks_used=used, kv_blocks_cached=cached,
                                          step=step))


def test_collector_from_scripted_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = ServerMetrics("m", 64)
    t0 = time.monotonic() - 1.8
    # "Now" is t0 + 1.8, also for the Prometheus gauge, which reads the collector's clock at scrape time.
    monkeypatch.setattr(collector_module, "time", SimpleNamespace(monotonic=lambda: t0 + 1.8))
    collector = StatsCollector(_info(1e4), metrics, "served", "9.9", DashboardOptions(max_requests=2), started=t0)
    collector.on_submit("a", [1, 2, 3, 4, 5], t0)
    collector.on_submit("b", [1, 2], t0 + 0.1)
    timings = RequestTimings(t0, first_scheduled_time=t0 + 0.2)
    # Step 1: a's first prompt chunk; b preempted before it started.
    collector.on_step(_step([], used=2, step=StepStats(0.1, 3, 0, 3, [("a", 3)], ["b"])), t0 + 0.3)
    # Step 2: a's last chunk gives its first token.
    timings = RequestTimings(t0, t0 + 0.2, first_token_time=t0 + 0.4)
    metrics.prompt_tokens.inc(5)
    metrics.generation_tokens.inc(1)
    collector.on_step(_step([RequestDelta("a", [SequenceDelta(0, [7])], False, 5, 0, timings)], used=2,
                            step=StepStats(0.1, 2, 0, 5, [("a", 2)])), t0 + 0.4)
    # Steps 3-4 (next second): decodes; 6 and 7 context tokens read.
    for i, ctx in enumerate((6, 7)):
        metrics.generation_tokens.inc(1)
        collector.on_step(_step([RequestDelta("a", [SequenceDelta(0, [8 + i], None, "length" if i else None)],
                                              bool(i), 5, 0, RequestTimings(t0, t0 + 0.2, t0 + 0.4,
                                                                            t0 + 1.6 if i else None))],
                                used=2 - 2 * i, cached=2 * i, step=StepStats(0.25, 0, 1, ctx)), t0 + 1.5 + 0.1 * i)
    metrics.success["length"].inc()
    metrics.rejected.inc()
    collector.on_release("b", t0 + 1.7, None)                 # the client left
    snap = collector.snapshot(t0 + 1.8)

    assert snap["now"]["kv_blocks"] == {"used": 0, "cached": 2, "free": 32 - 2, "total": 32}
    totals = snap["totals"]
    assert (totals["prompt_tokens"], totals["generation_tokens"], totals["requests"], totals["rejected"]) == (5, 3, 1, 1)
    series = snap["series"]
    assert sum(series["generation_tok_s"]) == 3 and sum(series["prompt_tok_s"]) == 5
    # Everything in one second still has a rate: the baseline row precedes the start.
    quick = StatsCollector(_info(None), ServerMetrics("q", 64), "q", "1", DashboardOptions(), started=t0)
    quick.metrics.generation_tokens.inc(4)
    quick_rates = quick.snapshot(t0 + 0.01)["series"]["generation_tok_s"]
    assert quick_rates[-1] == 4.0 and sum(quick_rates) == 4.0
    # efficiency: (2 x 1000 weights + (6 + 7) x 10 KV bytes) / (2 x 0.25 s), over 1e4 B/s.
    achieved = (2 * 1000 + 13 * 10) / 0.5
    assert snap["efficiency"]["decode_bytes_per_s"] == pytest.approx(achieved)
    assert snap["efficiency"]["utilization"] == pytest.approx(achieved / 1e4)
    values, _ = read_registry(metrics.registry)
    assert values["pagedserve_decode_bandwidth_utilization"] == pytest.approx(achieved / 1e4)
    b, a = snap["requests"]                                 # newest first
    assert (a["id"], a["state"], a["finish_reason"], a["output_tokens"]) == ("a", "finished", "length", 3)
    assert a["prefill_chunks"] == [[pytest.approx(0.3), 3], [pytest.approx(0.4), 2]]
    assert (a["queued_s"], a["first_token_s"], a["finished_s"]) == (pytest.approx(0.2), pytest.approx(0.4),
                                                                    pytest.approx(1.6))
    assert (b["id"], b["finish_reason"], b["preempted_s"]) == ("b", "abort", [pytest.approx(0.2)])
    assert "prompt" not in a                                # not without --dashboard-show-prompts


def test_cpu_efficiency_is_not_applicable() -> None:
    metrics = ServerMetrics("m", 64)
    collector = StatsCollector(_info(None), metrics, "m", "1", DashboardOptions(), started=49.0)
    collector.on_step(_step([], step=StepStats(0.5, 0, 2, 10)), 50.0)
    eff = collector.snapshot(50.5)["efficiency"]
    assert eff["utilization"] is None and eff["note"].startswith("n/a")
    assert eff["decode_bytes_per_s"] == pytest.approx((1000 + 100) / 0.5)
    values, _ = read_registry(metrics.registry)
    assert "pagedserve_decode_bandwidth_utilization" not in values
    assert collector.snapshot(50.5 + EFFICIENCY_WINDOW_S + 1)["efficiency"]["decode_bytes_per_s"] is None


def test_lora_adapters_of_the_last_step() -> None:
    info = ModelInfo("m", 64, 100, (), num_kv_blocks=33, block_size=4, max_num_seqs=8,
                     tokenizer=TokenizerSource("/nonexistent"), max_loras=2)
    collector = StatsCollector(info, ServerMetrics("m", 64, max_loras=2), "m", "1", DashboardOptions(), started=49.0)
    collector.on_step(StepOutput([], EngineStats(num_running=3, running_loras=["chat", "sql"],
                                                 waiting_loras=["math"])), 50.0)
    assert collector.snapshot(50.5)["now"]["lora"] == {"max_loras": 2, "running": ["chat", "sql"], "waiting": ["math"]}
    off = StatsCollector(_info(None), ServerMetrics("m", 64), "m", "1", DashboardOptions(), started=49.0)
    assert off.snapshot(50.5)["now"]["lora"] is None
