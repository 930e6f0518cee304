"""Stand-ins for the engine, so that the HTTP layer can be tested in-process without a model."""
from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

from fastapi import FastAPI
from fastapi.testclient import TestClient
from transformers import AutoTokenizer


class FakeEngine:
    """The LLMEngine surface the server uses, without a model."""

    def __init__(self) -> None:
        from engine.tiny_model import ensure_tokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(ensure_tokenizer()))
        self.model_name = "scripted"
        self.max_model_len = 64
        self.vocab_size = len(self.tokenizer)
        self.default_sampling: dict = {}

    def check_request(self, prompt_token_ids: list[int], params) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")


class ScriptedLoop:
    """Stands in for EngineLoop: records what the front end asks for; the test delivers the steps."""

    def __init__(self, engine: FakeEngine, deliver) -> None:
        self.engine, self.deliver = engine, deliver
        self.added: queue.Queue = queue.Queue()
        self.aborts: list[tuple] = []
        self.error: BaseException | None = None
        self._alive = False

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self) -> None:
        self._alive = True

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None) -> None:
        self.engine.check_request(prompt_token_ids, params)
        self.added.put((request_id, prompt_token_ids, params, arrival_time))

    def abort(self, request_id, seq_index=None, finish_reason="abort") -> None:
        self.aborts.append((request_id, seq_index, finish_reason))

    def shutdown(self, timeout=None) -> None:
        self._alive = False

    def die(self) -> None:
        self.error = RuntimeError("simulated engine crash")
        self._alive = False


def scripted_app(**options) -> tuple[FastAPI, list[ScriptedLoop]]:
    """An app on a FakeEngine whose loop the test drives; `options` go to create_app."""
    from server.app import create_app
    loops: list[ScriptedLoop] = []

    def factory(engine: FakeEngine, deliver: Callable) -> ScriptedLoop:
        loops.append(ScriptedLoop(engine, deliver))
        return loops[0]

    return create_app(FakeEngine(), loop_factory=factory, **options), loops


def scripted_client(**options) -> Iterator[tuple[TestClient, list[ScriptedLoop]]]:
    app, loops = scripted_app(**options)
    with TestClient(app) as client:
        yield client, loops
