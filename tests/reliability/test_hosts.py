"""The Host allow-list (DNS-rebinding defence): on every route, probes included, a Host not on the list gets
421 (400 when missing or malformed) in the error envelope; the localhost names pass with any port; the
default depends on the bind address; the flag parses and refuses what is not a host name."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.cli import build_parser
from server.errors import is_anthropic_path
from server.security import LOOPBACK_HOSTS, default_allowed_hosts, host_name, parse_allowed_hosts
from server.settings import resolve_settings
from tests.reliability.test_access import _every_route
from tests.server.fakes import scripted_client
from tests.server.openapi import assert_valid

KEY = "k3y"
FOREIGN = ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", "[::2]:80",
           "0.0.0.0", "localhostx")


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    for c, _ in scripted_client(api_key=KEY, allowed_hosts=LOOPBACK_HOSTS):
        yield c


def test_every_route_refuses_a_foreign_host(client: TestClient) -> None:
    for method, path in _every_route(client):
        for host in FOREIGN:
            response = client.request(method, path, headers={"Host": host, "Authorization": f"Bearer {KEY}"},
                                      json={})
            assert response.status_code == 421, (method, path, host)
            if is_anthropic_path(path):      # Anthropic's routes answer in its shape (no code there)
                assert response.json()["type"] == "error" and "--allowed-hosts" in response.json()["error"]["message"]
                continue
            assert_valid(response.json(), "ErrorResponse")
            assert response.json()["error"]["code"] == "host_not_allowed"
        for host in ("localhost", "LOCALHOST:1234", "127.0.0.1:8000", "[::1]:8000", "[::1]", "localhost."):
            response = client.request(method, path, headers={"Host": host}, json={})
            assert response.status_code != 421, (method, path, host)


def test_a_malformed_host_is_a_400(client: TestClient) -> None:
    for host in ("", "localhost:80:80", "[::1", "localhost:http", "a b", "user@localhost"):
        response = client.get("/health", headers={"Host": host})
        assert response.status_code == 400, host
        assert response.json()["error"]["code"] == "invalid_host"


def test_any_host_without_the_list() -> None:
    for c, _ in scripted_client():
        assert c.get("/health", headers={"Host": "evil.example"}).status_code == 200


def test_host_name_parsing() -> None:
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:9") == "[::1]"
    assert host_name("example.com.") == "example.com"
    assert host_name("[::1]x") is None and host_name(":80") is None


def test_defaults_follow_the_bind_address() -> None:
    for bind in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert default_allowed_hosts(bind) == LOOPBACK_HOSTS, bind
    for bind in ("0.0.0.0", "::", "10.1.2.3", "myhost"):
        assert default_allowed_hosts(bind) == ("*",), bind


def test_the_flag() -> None:
    def settings(argv: list[str], env: dict[str, str]):
        return resolve_settings(build_parser().parse_args(["serve", *argv]), env)

    assert settings([], {}).allowed_hosts is None
    assert settings(["--allowed-hosts", "api.example.com, [::1] ,10.0.0.5"], {}).allowed_hosts == (
        "api.example.com", "[::1]", "10.0.0.5")
    assert settings([], {"PAGEDSERVE_ALLOWED_HOSTS": "*"}).allowed_hosts == ("*",)
    for bad in ("http://x.example", "x.example:80", "a/b", ","):
        with pytest.raises(ValueError, match="host"):
            parse_allowed_hosts(bad)

