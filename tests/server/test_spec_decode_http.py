"""Speculative decoding through the server (--speculative-config): greedy text equal to a server without it,
streamed and not, stop strings cut in the same place, and the spec_decode counters add up on /metrics, under
vLLM's names too, and on /v1/stats."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import random_prompts
from tests.server.conftest import MODEL_NAME, pick_stop, start_server
from tests.server.prom import parse
from tests.server.server_proc import ServerProcess
from tests.server.sse import stream_events, texts_by_index

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PROMPTS = [p + p[: len(p) // 2] for p in random_prompts(1000, [9, 17, 30, 44, 5, 23], seed=8)]


@pytest.fixture(scope="module")
def spec_server(tiny_checkpoint) -> Iterator[ServerProcess]:
    proc = start_server(tiny_checkpoint, "--speculative-config", NGRAM, "--vllm-metric-names")
    yield proc
    proc.stop()


def complete(base_url: str, prompt, **kw) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0.0, **kw}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_greedy_text_equals_the_server_without_drafts(server, spec_server):
    for prompt in PROMPTS:
        ref = complete(server.base_url, prompt)
        got = complete(spec_server.base_url, prompt)
        assert (got["text"], got["finish_reason"]) == (ref["text"], ref["finish_reason"])
        with httpx.Client(base_url=spec_server.base_url, timeout=60) as client:
            events = stream_events(client, "/v1/completions",
                                   {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0.0})
        assert texts_by_index(events) == {0: ref["text"]}


def test_stop_strings_cut_in_the_same_place(server, spec_server):
    for prompt in PROMPTS[:3]:
        stop = pick_stop(complete(server.base_url, prompt)["text"])
        ref = complete(server.base_url, prompt, stop=[stop])
        got = complete(spec_server.base_url, prompt, stop=[stop])
        assert (got["text"], got["finish_reason"], got["stop_reason"]) == (ref["text"], "stop", stop)


def test_counters_add_up(spec_server):
    for prompt in PROMPTS:
        complete(spec_server.base_url, prompt, max_tokens=32)
    text = httpx.get(f"{spec_server.base_url}/metrics").text
    m = parse(text)
    drafts = m["pagedserve_spec_decode_num_drafts_total"]
    draft_tokens = m["pagedserve_spec_decode_num_draft_tokens_total"]
    accepted = m["pagedserve_spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f"pagedserve_spec_decode_num_accepted_tokens_per_pos_total{{{p}}}"] for p in range(3)]
    assert drafts > 0 and accepted > 0
    assert accepted <= draft_tokens <= 3 * drafts and drafts <= draft_tokens
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        line = f'vllm:spec_decode_{name}_total{{model_name="{MODEL_NAME}"}}'
        assert any(row.startswith(line) and float(row.split()[-1]) == m[f"pagedserve_spec_decode_{name}_total"]
                   for row in text.splitlines()), line
    spec = httpx.get(f"{spec_server.base_url}/v1/stats").json()["now"]["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert spec["accepted_tokens"] >= accepted and spec["draft_tokens"] >= draft_tokens
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]


def test_no_spec_counters_without_speculation(server):
    assert "spec_decode" not in httpx.get(f"{server.base_url}/metrics").text
    assert httpx.get(f"{server.base_url}/v1/stats").json()["now"]["speculative"] is None


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
])
def test_a_bad_config_stops_the_server(tiny_checkpoint, value, message):
    proc = ServerProcess("--model", str(tiny_checkpoint), "--device", "cpu", "--max-model-len", "64",
                         "--speculative-config", value)
    with pytest.raises(RuntimeError, match="--speculative-config") as err:
        proc.wait_ready()
    proc.stop()
    assert message in str(err.value)


def test_a_draft_model_server_gives_the_same_text(server, tiny_checkpoint):
    draft = f'{{"method": "draft_model", "model": "{tiny_checkpoint}", "num_speculative_tokens": 2}}'
    proc = start_server(tiny_checkpoint, "--speculative-config", draft)
    try:
        for prompt in PROMPTS[:4]:
            ref = complete(server.base_url, prompt)
            got = complete(proc.base_url, prompt)
            assert (got["text"], got["finish_reason"]) == (ref["text"], ref["finish_reason"])
        m = parse(httpx.get(f"{proc.base_url}/metrics").text)
        assert m["pagedserve_spec_decode_num_accepted_tokens_total"] == m["pagedserve_spec_decode_num_draft_tokens_total"] > 0
    finally:
        proc.stop()
