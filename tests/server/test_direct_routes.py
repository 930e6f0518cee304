"""The generation routes answered below FastAPI's routing (server/direct_routes.py) answer exactly what the
FastAPI routes answer: every bad body of the error tables gets the same status and the same envelope."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from server.direct_routes import DirectRoutes
from tests.server.bad_inputs import BAD_CHATS, BAD_COMPLETIONS, BAD_RAW_BODIES
from tests.server.fakes import scripted_app

OK_COMPLETION = {"model": "scripted", "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2}
JSON = {"content-type": "application/json"}

# (path, raw body, content type): the error tables, and what only the door checks.
CASES = {
    **{f"completion: {k}": ("/v1/completions", json.dumps({**OK_COMPLETION, **v}).encode(), JSON)
       for k, v in BAD_COMPLETIONS.items()},
    **{f"chat: {k}": ("/v1/chat/completions",
                      json.dumps({k2: v2 for k2, v2 in {**OK_CHAT, **v}.items() if v2 is not None}).encode(), JSON)
       for k, v in BAD_CHATS.items()},
    **{f"raw: {k}": (path, raw, JSON) for k, (path, raw) in BAD_RAW_BODIES.items() if path != "/tokenize"},
    "form body": ("/v1/completions", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    "no content type": ("/v1/chat/completions", json.dumps(OK_CHAT).encode(), {}),
    "JSON array": ("/v1/completions", b"[1, 2]", JSON),
    "body too large": ("/v1/completions", b'{"prompt": "' + b"x" * 70_000 + b'"}', JSON),
}


def _fastapi_only(app: FastAPI) -> FastAPI:
    """The same app with every route left to FastAPI (before its middleware stack is built)."""
    app.user_middleware = [m for m in app.user_middleware if m.cls is not DirectRoutes]
    return app


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient]]:
    direct, _ = scripted_app(max_body_bytes=64 * 1024)
    reference, _ = scripted_app(max_body_bytes=64 * 1024)
    with TestClient(direct) as a, TestClient(_fastapi_only(reference)) as b:
        yield a, b


@pytest.mark.parametrize("case", list(CASES))
def test_same_answer_as_the_fastapi_route(clients: tuple[TestClient, TestClient], case: str) -> None:
    path, raw, headers = CASES[case]
    direct, reference = (c.post(path, content=raw, headers=headers) for c in clients)
    assert 400 <= direct.status_code < 500
    assert (direct.status_code, direct.json()) == (reference.status_code, reference.json())


def test_only_the_generation_posts_skip_fastapi_routing(clients: tuple[TestClient, TestClient],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    routed: list[str] = []
    handle = APIRoute.handle

    async def counting_handle(self: APIRoute, scope, receive, send) -> None:
        routed.append(f"{scope['method']} {scope['path']}")
        await handle(self, scope, receive, send)

    monkeypatch.setattr(APIRoute, "handle", counting_handle)
    direct, _ = clients
    assert direct.post("/v1/completions", json={"prompt": 5}).status_code == 400
    assert direct.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert routed == []
    assert direct.get("/v1/completions").status_code == 405        # other methods: FastAPI's answer
    assert direct.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    assert direct.get("/v1/models").status_code == 200
    assert routed == ["GET /v1/completions", "POST /tokenize", "GET /v1/models"]
