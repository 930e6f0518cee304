"""A scripted EngineClient, so that the HTTP layer can be tested in-process without a model or a process."""
from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.messages import AddRequest, LoRAControl, StepOutput
from engine.model_info import ModelInfo, TokenizerSource
from engine.outputs import EngineStats, RequestDelta
from server.engine_client import OnDeath, OnOutput


def scripted_info() -> ModelInfo:
    from transformers import AutoTokenizer

    from engine.tiny_model import ensure_tokenizer
    path = ensure_tokenizer()
    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    return ModelInfo("scripted", max_model_len=64, vocab_size=vocab, eos_token_ids=(), num_kv_blocks=65,
                     block_size=16, max_num_seqs=64, tokenizer=TokenizerSource(str(path)))


class ScriptedClient:
    """Stands in for the engine process: records what the front end asks for; the test, from its own
    thread (like the engine's), delivers the steps."""

    def __init__(self) -> None:
        self._info = scripted_info()
        self.tokenizer = self._info.tokenizer.load()
        self.added: queue.Queue = queue.Queue()       # (request_id, prompt_token_ids, params, arrival_time)
        self.aborts: list[tuple] = []
        self.faults: list[str] = []
        self.lora_controls: list[LoRAControl] = []
        self._alive = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_output: OnOutput | None = None
        self._on_death: OnDeath | None = None

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self, on_output: OnOutput, on_death: OnDeath) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_output, self._on_death = on_output, on_death
        self._alive = True

    def add(self, request: AddRequest) -> None:
        self.added.put((request.request_id, request.prompt_token_ids, request.params, request.arrival_time))

    def abort(self, request_id: str, seq_index: int | None = None, finish_reason: str = "abort") -> None:
        self.aborts.append((request_id, seq_index, finish_reason))

    def control_lora(self, control: LoRAControl) -> None:
        self.lora_controls.append(control)

    def arm_fault(self, kind: str) -> None:
        self.faults.append(kind)

    async def shutdown(self, timeout: float) -> None:
        self._alive = False

    # --- the test's side ---------------------------------------------------------------------------
    def deliver(self, deltas: list[RequestDelta], stats: EngineStats) -> None:
        self._loop.call_soon_threadsafe(self._on_output, StepOutput(deltas, stats))

    def die(self) -> None:
        self._alive = False
        self._loop.call_soon_threadsafe(self._on_death, "simulated engine crash")


def scripted_app(**options) -> tuple[FastAPI, list[ScriptedClient]]:
    """An app on a ScriptedClient the test drives; `options` go to create_app."""
    from server.app import create_app
    client = ScriptedClient()
    return create_app(client, **options), [client]


async def asgi_post(app, path: str, body: bytes, send) -> None:
    """One POST straight through the ASGI app, on the running event loop: the test's `send` sees every message
    the app sends, in order, with no server or socket in between. The client never disconnects."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]}
    await app(scope, receive, send)


async def loop_turns(n: int = 10) -> None:
    """Lets the event loop run everything that is ready, n times over (no clock involved)."""
    for _ in range(n):
        await asyncio.sleep(0)


def scripted_client(**options) -> Iterator[tuple[TestClient, list[ScriptedClient]]]:
    app, clients = scripted_app(**options)
    with TestClient(app) as client:
        yield client, clients
