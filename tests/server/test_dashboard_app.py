"""The dashboard's routes in-process on a scripted engine: the page is public and self-contained (no
remote resource, a strict CSP), /v1/stats needs the key, --no-dashboard removes both (404), and prompts and
outputs show only with --dashboard-show-prompts."""
from __future__ import annotations

import re
import threading

from engine.outputs import EngineStats, RequestDelta, RequestTimings, SequenceDelta, StepStats
from server.dashboard.collector import DashboardOptions
from server.dashboard.routes import PAGE_PATHS
from tests.server.fakes import ScriptedClient, scripted_client

KEY = "dash-key"


def _answer_one(loop: ScriptedClient, text: str) -> threading.Thread:
    """Plays the engine for one request: one prefill chunk, then the whole answer in one step."""
    def run() -> None:
        request_id, prompt, _, arrival = loop.added.get(timeout=10)
        loop.deliver([], EngineStats(num_running=1, kv_blocks_used=1, step=StepStats(0.01, len(prompt), 0,
                                                                                      len(prompt), [(request_id, len(prompt))])))
        ids = loop.tokenizer.encode(text, add_special_tokens=False)
        timings = RequestTimings(arrival, arrival, arrival, arrival + 0.01)
        loop.deliver([RequestDelta(request_id, [SequenceDelta(0, ids, None, "length")], True, len(prompt), 0, timings)],
                     EngineStats(num_running=0, kv_blocks_cached=1))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_page_is_public_and_stats_need_the_key() -> None:
    for client, _ in scripted_client(api_key=KEY):
        for path in PAGE_PATHS:
            response = client.get(path)
            assert response.status_code == 200, path
            assert "default-src 'none'" in response.headers["content-security-policy"]
            assert not re.search(r"(src|href)=\"(https?:)?//", response.text), "a remote resource"
        page = client.get("/dashboard").text
        assert 'src="/dashboard/dashboard.js"' in page and 'href="/dashboard/dashboard.css"' in page
        assert '<meta name="pagedserve-api-key" content="required">' in page     # it asks before a 401
        assert "localStorage" not in client.get("/dashboard/dashboard.js").text   # the key stays in memory
        assert client.get("/v1/stats").status_code == 401
        stats = client.get("/v1/stats", headers={"Authorization": f"Bearer {KEY}"})
        assert stats.status_code == 200 and stats.json()["server"]["served_model_name"] == "scripted"


def test_no_dashboard_means_404() -> None:
    for client, [loop] in scripted_client(dashboard=DashboardOptions(enabled=False)):
        for path in (*PAGE_PATHS, "/v1/stats"):
            response = client.get(path)
            assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
        assert client.app.state.ctx.async_engine.observer is None
    for client, _ in scripted_client():
        assert '<meta name="pagedserve-api-key" content="no">' in client.get("/dashboard").text


def test_prompts_show_only_when_asked() -> None:
    for show in (False, True):
        for client, [loop] in scripted_client(dashboard=DashboardOptions(show_prompts=show)):
            player = _answer_one(loop, " secret answer")
            body = client.post("/v1/completions", json={"prompt": "my secret prompt", "max_tokens": 3}).json()
            player.join()
            [request] = client.get("/v1/stats").json()["requests"]
            assert request["state"] == "finished" and request["finish_reason"] == "length"
            assert request["prompt_tokens"] == body["usage"]["prompt_tokens"]
            assert request["output_tokens"] == body["usage"]["completion_tokens"]
            assert [n for _, n in request["prefill_chunks"]] == [body["usage"]["prompt_tokens"]]
            if show:
                assert request["prompt"] == "my secret prompt" and request["output"] == body["choices"][0]["text"]
            else:
                assert "prompt" not in request and "output" not in request
                assert "secret" not in client.get("/v1/stats").text
