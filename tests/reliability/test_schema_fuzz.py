"""schemathesis against the server's own /openapi.json: no 5xx, and no response the document does not declare
(status, content type, headers, body schema, SSE events). Seeded and bounded.

The server runs with an API key (from PAGEDSERVE_API_KEY), so the document declares bearer auth and
schemathesis also checks that requests without it are refused. One check is left out: positive_data_acceptance
expects every schema-valid request to succeed, but some rules span fields or depend on the model (prompt +
max_tokens within the context, token ids within the vocabulary, min_tokens <= max_tokens) and a schema
cannot state them; such requests get a 400, which the document declares.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server

API_KEY = "fuzz-key-0123456789"
SEED = 20261122
OPERATIONS = 17     # completions, chat, embeddings, messages, count_tokens, responses (create, retrieve, delete,
#                    input_items), tokenize, detokenize, tokenizer_info, models, model, health, version, metrics


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator:
    # A short context keeps every generation the fuzzer manages to start short.
    proc = start_server(tiny_checkpoint, "--max-model-len", "64", "--max-num-seqs", "8",
                        env={"PAGEDSERVE_API_KEY": API_KEY})
    yield proc
    proc.stop()


def test_the_document_covers_every_public_route(server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.base_url + "/openapi.json").status_code == 401
    doc = httpx.get(server.base_url + "/openapi.json", headers=headers).json()
    operations = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert len(operations) == OPERATIONS
    assert not any(path.startswith("/_fault") for _, path in operations)
    for method, path in operations:
        responses = doc["paths"][path][method.lower()]["responses"]
        assert "422" not in responses                       # validation errors are 400s here
        assert ("401" in responses) == (path not in ("/health", "/metrics"))


def test_schemathesis_finds_no_server_error_and_no_schema_violation(server, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.base_url}/openapi.json",
               "--header", f"Authorization: Bearer {API_KEY}",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
               "--phases", "coverage,fuzzing,stateful", "--max-examples", "40", "--seed", str(SEED),
               "--workers", "1", "--generation-database", "none", "--request-timeout", "30",
               "--output-sanitize", "false", "--no-color"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = result.stdout[-12000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert f"Tested: {OPERATIONS}" in result.stdout, report
    assert "Traceback" not in server.log_tail(500_000)
