"""/metrics: names, labels and exact arithmetic after a known workload."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.conftest import MODEL_NAME, pick_stop
from tests.server.prom import scrape

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens"]
COUNTERS = ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
            "prefix_cache_queries", "prefix_cache_hits"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]


def test_metric_names_exist(http: httpx.Client) -> None:
    samples = scrape(http)
    for name in GAUGES:
        assert f"pagedserve_{name}" in samples
    for name in COUNTERS:
        assert any(k.startswith(f"pagedserve_{name}_total") for k in samples), name
    for name in HISTOGRAMS:
        for suffix in ("_sum", "_count"):
            assert f"pagedserve_{name}{suffix}" in samples
        assert any(k.startswith(f"pagedserve_{name}_bucket") for k in samples)
    for reason in ("stop", "length", "abort", "error"):
        assert f"pagedserve_request_success_total{{{reason}}}" in samples
    assert 0.0 <= samples["pagedserve_kv_cache_usage_perc"] <= 1.0
    text = http.get("/metrics").text
    assert "pagedserve_prompt_tokens_total{" in text and "_created" not in text   # no *_created series


def test_counts_are_exact(http: httpx.Client) -> None:
    num_requests, max_tokens, prompt = 5, 6, [11, 22, 33, 44, 55, 66, 77]
    before = scrape(http)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    with ThreadPoolExecutor(num_requests) as pool:
        results = list(pool.map(lambda _: http.post("/v1/completions", json=body), range(num_requests)))
    assert all(r.status_code == 200 for r in results)
    after = scrape(http)

    def grew(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    n, m, p = num_requests, max_tokens, len(prompt)
    assert grew("pagedserve_time_to_first_token_seconds_count") == n
    assert grew("pagedserve_e2e_request_latency_seconds_count") == n
    assert grew("pagedserve_request_queue_time_seconds_count") == n
    assert grew("pagedserve_inter_token_latency_seconds_count") == n * (m - 1)
    assert grew("pagedserve_generation_tokens_total") == n * m
    assert grew("pagedserve_prompt_tokens_total") == n * p
    assert grew("pagedserve_request_prompt_tokens_sum") == n * p
    assert grew("pagedserve_request_generation_tokens_sum") == n * m
    assert grew("pagedserve_request_success_total{length}") == n
    assert grew("pagedserve_request_success_total{stop}") == 0
    assert grew("pagedserve_prefix_cache_queries_total") >= grew("pagedserve_prefix_cache_hits_total") >= 0
    # Histogram buckets are cumulative and end at the count.
    buckets = sorted((float(k.split("[le=")[1][:-1]), v) for k, v in after.items()
                     if k.startswith("pagedserve_request_generation_tokens_bucket"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert buckets[-1][1] == after["pagedserve_request_generation_tokens_count"]
    assert after["pagedserve_num_requests_running"] == 0 and after["pagedserve_num_requests_waiting"] == 0
    assert grew("pagedserve_endpoint_requests_total{/v1/completions}") == n
    assert grew("pagedserve_endpoint_prompt_tokens_total{/v1/completions}") == n * p
    assert grew("pagedserve_endpoint_generation_tokens_total{/v1/completions}") == n * m


def test_requests_and_tokens_are_counted_by_endpoint(http: httpx.Client) -> None:
    before = scrape(http)
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 5, "ignore_eos": True, "n": 2,
                                                   "messages": [{"role": "user", "content": "hello"}]}).json()
    text = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 4,
                                               "ignore_eos": True}).json()
    assert text["usage"]["completion_tokens"] == 4
    after = scrape(http)

    def grew(kind: str, endpoint: str) -> float:
        key = f"pagedserve_endpoint_{kind}_total{{{endpoint}}}"
        return after[key] - before.get(key, 0.0)

    assert grew("requests", "/v1/chat/completions") == 1 and grew("requests", "/v1/completions") == 1
    assert grew("prompt_tokens", "/v1/chat/completions") == chat["usage"]["prompt_tokens"]
    assert grew("generation_tokens", "/v1/chat/completions") == chat["usage"]["completion_tokens"] == 10
    assert grew("prompt_tokens", "/v1/completions") == 3 and grew("generation_tokens", "/v1/completions") == 4


def test_stop_finishes_are_labelled(http: httpx.Client) -> None:
    before = scrape(http)
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stopped = http.post("/v1/completions", json={**body, "stop": pick_stop(text, start=1, length=2)}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    after = scrape(http)
    assert after["pagedserve_request_success_total{stop}"] - before["pagedserve_request_success_total{stop}"] == 1
    assert (after["pagedserve_generation_tokens_total"] - before["pagedserve_generation_tokens_total"]
            == 8 + stopped["usage"]["completion_tokens"])


def test_batched_observations_equal_one_by_one() -> None:
    """observe_all (the per-step flush) leaves a histogram exactly as observe() per value would: same
    bucket counts, bit-identical sum, whatever the order; and a read of the registry flushes first."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from server.metrics import ServerMetrics, observe_all

    rng = random.Random(7)
    values = [rng.choice([0.0, 0.001, 0.005, 0.0125, 80.0, 1e6]) if i % 5 == 0 else rng.expovariate(30)
              for i in range(3000)]
    one, batched = (Histogram(name, "h", buckets=(0.001, 0.005, 0.01, 0.025, 0.1, 1.0, 80.0),
                              registry=CollectorRegistry()) for name in ("one", "batched"))
    one.observe(0.3)
    batched.observe(0.3)
    for v in values:
        one.observe(v)
    for i in range(0, len(values), 256):           # one flush per "step"
        observe_all(batched, values[i:i + 256])
    assert [b.get() for b in one._buckets] == [b.get() for b in batched._buckets]
    assert one._sum.get() == batched._sum.get()

    metrics = ServerMetrics("m", 64)
    metrics.count_tokens(3, None)
    metrics.count_tokens(2, 0.02)
    text = metrics.render().decode()           # not flushed by anyone but the read itself
    assert 'pagedserve_generation_tokens_total{model_name="m"} 5.0' in text
    assert 'pagedserve_inter_token_latency_seconds_count{model_name="m"} 1.0' in text
    assert 'pagedserve_inter_token_latency_seconds_sum{model_name="m"} 0.02' in text
