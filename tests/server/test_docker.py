"""The container files agree with the CLI: flags exist, port 8000, health check on /health, /metrics scraped."""
from __future__ import annotations

import json
import re

import yaml

from server.cli import build_parser
from server.settings import OPTIONS
from tests.server.server_proc import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
PROMETHEUS = yaml.safe_load((REPO_ROOT / "docker" / "prometheus.yml").read_text())
SERVE_FLAGS = {opt for action in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
               for opt in action.option_strings}


def _instruction(name: str) -> str:
    """One Dockerfile instruction, continuation lines joined."""
    text = DOCKERFILE.replace("\\\n", " ")
    [line] = [l for l in text.splitlines() if l.startswith(name + " ")]
    return line[len(name) + 1:].strip()


def test_entrypoint_runs_serve_on_all_interfaces_with_known_flags() -> None:
    entrypoint = json.loads(_instruction("ENTRYPOINT"))
    assert entrypoint[:2] == ["pagedserve", "serve"]
    args = entrypoint[2:]
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8000"
    assert {a for a in args if a.startswith("--")} <= SERVE_FLAGS


def test_exposed_port_health_check_and_user() -> None:
    assert _instruction("EXPOSE") == "8000"
    assert "127.0.0.1:8000/health" in _instruction("HEALTHCHECK")
    assert re.search(r"^USER (?!root)\w+", DOCKERFILE, re.M)
    assert re.search(r"^FROM \S*pytorch\S*cuda", DOCKERFILE, re.M)
    env_names = set(re.findall(r"(PAGEDSERVE_[A-Z_]+)=", DOCKERFILE)) - {"PAGEDSERVE_CACHE"}
    assert env_names <= {opt.env for opt in OPTIONS}


def test_compose_matches_the_cli_and_prometheus_scrapes_metrics() -> None:
    service_name, service = next((k, v) for k, v in COMPOSE["services"].items() if "build" in v)
    assert {a for a in service["command"] if a.startswith("--")} <= SERVE_FLAGS
    assert "8000:8000" in service["ports"]
    assert any(v.endswith(":/models/model:ro") for v in service["volumes"])
    assert "127.0.0.1:8000/health" in " ".join(service["healthcheck"]["test"])
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    [job] = PROMETHEUS["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"{service_name}:8000"]
    assert "prometheus" in COMPOSE["services"]
