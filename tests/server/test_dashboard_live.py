"""The dashboard against a real `pagedserve serve --model tiny-random` behind an API key: after a known
number of requests /v1/stats agrees with /metrics; a foreign Host is refused on the page too; and a real
headless chromium (Debian's, driven by playwright) loads the page, is asked for the key, shows the same
numbers as /metrics, logs no console error, and takes a screenshot.

PAGEDSERVE_DASHBOARD_SCREENSHOT=docs/dashboard.png also writes the screenshot there (the README's).
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.dashboard.quantiles import Buckets, histogram_quantile
from tests.server.server_proc import REPO_ROOT, ServerProcess

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_PLAIN, NUM_STREAMED, MAX_TOKENS = 6, 2, 12
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def scrape(http: httpx.Client) -> tuple[dict[str, float], dict[str, list[tuple[float, float]]]]:
    """/metrics as {name{labels}: value} (model_name left out) and the histograms' (le, count) pairs."""
    from prometheus_client.parser import text_string_to_metric_families
    values: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.setdefault(family.name, []).append((float(s.labels["le"]), s.value))
            else:
                extra = ",".join(v for k, v in sorted(s.labels.items()) if k != "model_name")
                values[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return values, buckets


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", "tiny-random", "--device", "cpu", "--max-model-len", "256",
                         "--max-num-seqs", "8", "--num-kv-blocks", "64", "--max-num-batched-tokens", "64",
                         env={"PAGEDSERVE_API_KEY": KEY}).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def traffic(server: ServerProcess) -> dict[str, float]:
    """A known number of requests (some sharing a prefix, some streamed); then /metrics once idle."""
    shared = "The quick brown fox jumps over the lazy dog. " * 4
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120.0) as http:
        for i in range(NUM_PLAIN):
            body = {"prompt": shared + f"request {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
        for i in range(NUM_STREAMED):
            body = {"messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.read().decode().rstrip().endswith("data: [DONE]")
        values, _ = scrape(http)
    return values


def test_stats_match_metrics(server: ServerProcess, traffic: dict[str, float]) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        assert http.get("/v1/stats").status_code == 401
        stats = http.get("/v1/stats", headers=AUTH).json()
        values, buckets = scrape(http)
    total = NUM_PLAIN + NUM_STREAMED
    assert values["pagedserve_request_success_total{length}"] == total
    totals = stats["totals"]
    assert totals["requests"] == total and totals["finished"]["length"] == total
    assert totals["generation_tokens"] == values["pagedserve_generation_tokens_total"] == total * MAX_TOKENS
    assert totals["prompt_tokens"] == values["pagedserve_prompt_tokens_total"]
    assert totals["prefix_cache_hits"] == values["pagedserve_prefix_cache_hits_total"] > 0
    assert totals["preemptions"] == values["pagedserve_num_preemptions_total"]
    series = stats["series"]
    assert sum(series["generation_tok_s"]) == total * MAX_TOKENS, series     # the whole run is in the window
    ttft = stats["latency"]["ttft"]["all"]
    pairs = sorted(buckets["pagedserve_time_to_first_token_seconds"])
    expected = histogram_quantile(0.5, Buckets(*map(tuple, zip(*pairs))))
    assert ttft["count"] == total and ttft["p50"] == pytest.approx(expected)
    assert stats["now"]["kv_blocks"]["used"] == 0 and stats["now"]["running"] == 0
    kv = stats["now"]["kv_blocks"]
    assert kv["cached"] > 0 and kv["used"] + kv["cached"] + kv["free"] == kv["total"] == 63
    requests = stats["requests"]
    assert len(requests) == total and all(r["state"] == "finished" and r["output_tokens"] == MAX_TOKENS
                                          for r in requests)
    assert all(sum(n for _, n in r["prefill_chunks"]) >= r["prompt_tokens"] - r["cached_tokens"] for r in requests)
    assert all("prompt" not in r for r in requests)
    assert stats["server"]["model"] == "tiny-random" and stats["efficiency"]["utilization"] is None


def test_foreign_host_is_refused(server: ServerProcess) -> None:
    """Raw Host headers over a real socket (the server is bound to 127.0.0.1: the loopback default)."""
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        for path in ("/dashboard", "/v1/stats", "/health", "/metrics"):
            response = http.get(path, headers={"Host": f"rebind.attacker.example:{server.port}", **AUTH})
            assert response.status_code == 421, path
            assert response.json()["error"]["code"] == "host_not_allowed"
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]"):
            assert http.get("/dashboard", headers={"Host": host}).status_code == 200, host


def _numbers(page, selector: str) -> str:
    return page.locator(selector).first.text_content().strip()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium; .ci/install does it "
                                             "where apt-get is available)")
def test_browser_shows_the_metrics(server: ServerProcess, traffic: dict[str, float], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text} ({m.location})") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(server.base_url + "/dashboard")
            page.wait_for_selector("#key-form:not([hidden])", timeout=60_000)   # it asks before any request
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            # Locator waits, not wait_for_function: when its predicate is not true at once, playwright polls
            # it with eval, which the page's Content-Security-Policy (script-src 'self') refuses.
            expect(page.locator("#status")).to_have_text("live", timeout=60_000)
            page.wait_for_selector("#requests .req", state="attached", timeout=60_000)
            values, _ = scrape(httpx.Client(base_url=server.base_url, timeout=30.0))
            total = NUM_PLAIN + NUM_STREAMED
            expected = {
                "requests": total, "finished_length": values["pagedserve_request_success_total{length}"],
                "generation_tokens": values["pagedserve_generation_tokens_total"],
                "prompt_tokens": values["pagedserve_prompt_tokens_total"],
                "preemptions": values["pagedserve_num_preemptions_total"],
                "rejected": values["pagedserve_num_requests_rejected_total"],
                "errors": values["pagedserve_request_success_total{error}"], "running": 0, "waiting": 0,
            }
            for name, value in expected.items():
                assert _numbers(page, f'[data-stat="{name}"]') == str(int(value)), name
            hit_rate = values["pagedserve_prefix_cache_hits_total"] / values["pagedserve_prefix_cache_queries_total"]
            assert _numbers(page, '[data-stat="hit_rate"]') == f"{hit_rate * 100:.1f}%"
            assert _numbers(page, '[data-latency="ttft-all"] [data-q="count"]') == str(total)
            assert page.locator("#requests .req").count() == total
            assert page.locator("#kv-map span").count() == 63
            assert re.fullmatch(r"n/a", _numbers(page, '[data-stat="efficiency"]'))
            assert _numbers(page, '[data-fact="model"]') == "tiny-random"
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    target = os.environ.get("PAGEDSERVE_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copyfile(shot, REPO_ROOT / target)
