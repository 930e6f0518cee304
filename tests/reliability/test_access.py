"""Auth and CORS, in-process on an engine stand-in: every route the app answers needs the key except /health,
/metrics and the dashboard page's static files (enumerated from the app itself, so a route added later is covered too); CORS admits only the
configured origins; the settings read the key from PAGEDSERVE_API_KEY."""
from __future__ import annotations

from collections.abc import Iterator
from unittest.mock import ANY

import pytest
from fastapi.testclient import TestClient

from server.cli import build_parser
from server.errors import is_anthropic_path
from server.security import PUBLIC_PATHS
from server.settings import resolve_settings
from tests.server.fakes import scripted_client
from tests.server.openapi import assert_valid

KEY = "s3cret-Key"
ORIGIN = "https://app.example.com"
GOOD = {"Authorization": f"Bearer {KEY}"}
BAD_CREDENTIALS = {
    "none": {},
    "wrong key": {"Authorization": "Bearer nope"},
    "wrong case": {"Authorization": f"Bearer {KEY.lower()}"},
    "key prefix": {"Authorization": f"Bearer {KEY[:-1]}"},
    "key plus suffix": {"Authorization": f"Bearer {KEY}x"},
    "basic scheme": {"Authorization": f"Basic {KEY}"},
    "no scheme": {"Authorization": KEY},
    "other header": {"X-Token": KEY},
    "wrong x-api-key": {"X-Api-Key": "nope"},
    "x-api-key prefix": {"X-Api-Key": KEY[:-1]},
    "bearer in x-api-key": {"X-Api-Key": f"Bearer {KEY}"},
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    for c, _ in scripted_client(api_key=KEY, allowed_origins=(ORIGIN,)):
        yield c


def _every_route(client: TestClient) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, documented or not, with path parameters filled in."""
    routes, pending = [], list(client.app.routes)
    while pending:
        route = pending.pop()
        if hasattr(route, "original_router"):       # an included APIRouter (FastAPI >= 0.16x keeps it whole)
            pending.extend(route.original_router.routes)
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                routes.append((method, route.path.replace("{model:path}", "m").replace("{model}", "m")
                               .replace("{response_id}", "resp_1")))
    return routes + [("GET", "/no/such/route"), ("POST", "/v1/unknown")]


def test_every_route_but_the_probes_needs_the_key(client: TestClient) -> None:
    routes = _every_route(client)
    assert {("GET", "/openapi.json"), ("GET", "/docs"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
            ("POST", "/tokenize"), ("POST", "/v1/messages"), ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"), ("GET", "/v1/responses/resp_1/input_items")} <= set(routes)
    for method, path in routes:
        for name, headers in BAD_CREDENTIALS.items():
            response = client.request(method, path, headers=headers, json={})
            if path in PUBLIC_PATHS:
                assert response.status_code == 200, (path, name)
                continue
            assert response.status_code == 401, (method, path, name)
            assert response.headers["www-authenticate"] == "Bearer"
            if is_anthropic_path(path):      # Anthropic's routes answer in its shape
                assert response.json()["error"] == {"type": "authentication_error", "message": ANY}
            else:
                assert_valid(response.json(), "ErrorResponse")
            assert KEY not in response.text
        for good in (GOOD, {"X-Api-Key": KEY}):
            assert client.request(method, path, headers=good, json={}).status_code != 401, (method, path)


def test_the_key_opens_the_api(client: TestClient) -> None:
    models = client.get("/v1/models", headers=GOOD)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "scripted"
    doc = client.get("/openapi.json", headers=GOOD).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"},
                                                    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}


def test_cors_admits_only_the_configured_origin(client: TestClient) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = client.options("/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    foreign = client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in foreign.headers
    simple = client.get("/v1/models", headers={"Origin": ORIGIN})          # a 401 a browser may read
    assert simple.status_code == 401 and simple.headers["access-control-allow-origin"] == ORIGIN


def test_without_options_there_is_no_key_and_no_cors() -> None:
    for client, _ in scripted_client():
        assert client.get("/v1/models").status_code == 200
        preflight = client.options("/v1/completions", headers={"Origin": ORIGIN,
                                                                "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers
        assert "securitySchemes" not in client.get("/openapi.json").json().get("components", {})


def test_settings_take_the_key_from_the_environment() -> None:
    def settings(argv: list[str], env: dict[str, str]):
        return resolve_settings(build_parser().parse_args(["serve", *argv]), env)

    defaults = settings([], {})
    assert defaults.api_key is None and defaults.allowed_origins == () and defaults.host == "127.0.0.1"
    assert settings([], {"PAGEDSERVE_API_KEY": "k1"}).api_key == "k1"
    assert settings(["--api-key", "k2"], {"PAGEDSERVE_API_KEY": "k1"}).api_key == "k2"
    both = settings(["--allowed-origins", f"{ORIGIN}, http://localhost:3000/"], {})
    assert both.allowed_origins == (ORIGIN, "http://localhost:3000")
    with pytest.raises(ValueError, match="origin"):
        settings([], {"PAGEDSERVE_ALLOWED_ORIGINS": "example.com"})
    for name, bad in (("PAGEDSERVE_MAX_QUEUE_LEN", "0"), ("PAGEDSERVE_REQUEST_TIMEOUT", "-1"),
                      ("PAGEDSERVE_DRAIN_TIMEOUT", "nan")):
        with pytest.raises(ValueError, match=name):
            settings([], {name: bad})
