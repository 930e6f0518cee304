"""Scrapes /metrics into a flat dict for arithmetic in tests."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME

GUARD_S = 60.0      # how long a test waits for a state before it fails: a guard against hanging, not a speed


def parse(text: str) -> dict[str, float]:
    """Samples keyed by name plus labels other than model_name and le, e.g.
    'pagedserve_request_success_total{length}', 'pagedserve_ttft..._bucket[le=0.1]'."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("pagedserve_"):
                continue
            assert s.labels.get("model_name") == MODEL_NAME, s
            extra = ",".join(v for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            key = s.name + (f"{{{extra}}}" if extra else "") + (f"[le={s.labels['le']}]" if "le" in s.labels else "")
            samples[key] = s.value
    return samples


def scrape(http: httpx.Client) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def is_idle(samples: dict[str, float], kv_baseline: float) -> bool:
    """Nothing runs or waits in the engine and its KV cache is back to `kv_baseline`."""
    return (samples["pagedserve_num_requests_running"] == 0 and samples["pagedserve_num_requests_waiting"] == 0
            and abs(samples["pagedserve_kv_cache_usage_perc"] - kv_baseline) < 1e-9)


def wait_until_idle(http: httpx.Client, kv_baseline: float, timeout: float = GUARD_S) -> dict[str, float]:
    """Polls until idle (is_idle); returns the last scrape, idle or not after `timeout` (a guard: the caller
    asserts what it needs)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(http)
        if is_idle(samples, kv_baseline) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)
