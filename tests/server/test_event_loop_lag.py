"""Nothing slow on the event loop: a huge prompt is refused (or tokenized) while the loop keeps answering.

A probe task on the server's event loop sleeps 10 ms at a time and records how late it wakes. Tokenizing a
10 MB prompt on the loop (what the server used to do) stalls it for seconds; the server must keep every
stall under 1 s, the issue's bound. What is left on the loop for a refused 10 MB prompt (reading and
parsing the body) costs tens of milliseconds, so the bound holds on machines many times slower than this
one: it is a guard with a wide margin, not a speed measurement. The requests run on the app in this process
(a scripted engine), so the probe runs on the very loop that serves them.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from tests.server.fakes import scripted_client

MAX_STALL_S = 1.0
HUGE = "the quick brown fox jumps over the lazy dog. " * (10 * 1024 * 1024 // 45)   # 10 MB


async def _probe(lags: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(time.perf_counter() - start - 0.01)


class LagProbe:
    def __init__(self, client) -> None:
        self.client, self.lags, self.stop = client, [], threading.Event()

    def __enter__(self) -> LagProbe:
        self.done = self.client.portal.start_task_soon(_probe, self.lags, self.stop)
        deadline = time.monotonic() + 30
        while not self.lags and time.monotonic() < deadline:    # the probe is running before we act
            time.sleep(0.005)
        assert self.lags
        self.lags.clear()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.done.result(timeout=30)

    @property
    def worst(self) -> float:
        return max(self.lags)


@pytest.fixture
def app_client() -> Iterator:
    for client, [engine] in scripted_client(max_body_bytes=32 * 1024 * 1024):
        yield client, engine


def _health_while(client, request) -> tuple[object, list[int]]:
    """Sends `request` (a callable) while another thread polls /health; returns its response and the
    /health statuses seen while it ran."""
    statuses: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            statuses.append(client.get("/health").status_code)
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        response = request()
    finally:
        done.set()
        poller.join()
    return response, statuses


def test_huge_prompt_is_refused_before_tokenizing_without_stalling_the_loop(app_client) -> None:
    client, engine = app_client
    ctx = client.app.state.ctx
    assert ctx.text.max_prompt_chars is not None and ctx.text.max_prompt_chars < len(HUGE)
    with LagProbe(client) as probe:
        r, statuses = _health_while(client, lambda: client.post("/v1/completions", json={"prompt": HUGE}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"{len(HUGE)} characters" in err["message"]
    assert "64 tokens" in err["message"]
    assert statuses and set(statuses) == {200}
    assert probe.worst < MAX_STALL_S, probe.lags
    assert engine.added.empty()


def test_huge_chat_message_is_refused_without_stalling_the_loop(app_client) -> None:
    client, engine = app_client
    with LagProbe(client) as probe:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": HUGE}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert probe.worst < MAX_STALL_S, probe.lags
    assert engine.added.empty()


def test_a_tokenizer_without_a_char_bound_tokenizes_off_the_loop(app_client) -> None:
    """Where no character bound holds (a tokenizer that may drop characters), the prompt is tokenized whole,
    in the tokenizer thread; the loop goes on meanwhile and the answer is the usual context-length 400."""
    client, engine = app_client
    client.app.state.ctx.text.max_prompt_chars = None
    prompt = HUGE[:3 * 1024 * 1024]
    with LagProbe(client) as probe:
        r, statuses = _health_while(client, lambda: client.post("/v1/completions", json={"prompt": prompt}))
    assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"]
    assert statuses and set(statuses) == {200}
    assert probe.worst < MAX_STALL_S, probe.lags
    assert engine.added.empty()


def test_tokenize_and_detokenize_of_big_inputs_run_off_the_loop(app_client) -> None:
    client, _ = app_client
    prompt = HUGE[:1024 * 1024]
    with LagProbe(client) as probe:
        r = client.post("/tokenize", json={"prompt": prompt})
        assert r.status_code == 200
        tokens = r.json()["tokens"]
        assert r.json()["count"] == len(tokens) > 64
        d = client.post("/detokenize", json={"tokens": tokens})
    assert d.status_code == 200 and d.json()["prompt"] == client.app.state.ctx.tokenizer.decode(tokens)
    assert probe.worst < MAX_STALL_S, probe.lags


def test_prompt_char_limit_is_a_true_bound_and_only_where_it_holds() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from server.text_work import prompt_char_limit
    from tests.server.fakes import scripted_info

    tok = scripted_info().tokenizer.load()            # byte-level BPE: every character is kept
    longest = max(tok.get_vocab(), key=len)
    assert prompt_char_limit(tok, 64) == 64 * len(longest)
    text = tok.convert_tokens_to_string([longest]) * 200   # the densest text there is: the longest token
    assert len(tok(text)["input_ids"]) * len(longest) >= len(text)

    def fast(pre, norm=None) -> PreTrainedTokenizerFast:
        inner = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, [("a", "b")], unk_token="[UNK]"))
        inner.pre_tokenizer = pre
        inner.normalizer = norm
        return PreTrainedTokenizerFast(tokenizer_object=inner)

    assert prompt_char_limit(fast(pre_tokenizers.WhitespaceSplit()), 64) is None   # drops whitespace
    assert prompt_char_limit(fast(pre_tokenizers.Metaspace(), normalizers.Lowercase()), 64) is None
    assert prompt_char_limit(fast(pre_tokenizers.Metaspace(), normalizers.NFC()), 64) == 64 * 5 * 4
