"""Validates responses against the official OpenAI schemas (a checked-in subset of openapi.yaml).

The spec still marks some fields with OpenAPI 3.0's `nullable: true`, which JSON Schema ignores; it is
rewritten here as "or null", which is what the spec means.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

_FIXTURE = Path(__file__).with_name("fixtures") / "openai_schemas.json"


def _with_nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_with_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _with_nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@lru_cache(maxsize=None)
def _schemas() -> dict[str, Any]:
    schemas = _with_nullable(json.loads(_FIXTURE.read_text())["schemas"])
    # A completion stream chunk shares CreateCompletionResponse, but finish_reason is null until a
    # choice's last chunk (as in OpenAI's own streams); the schema cannot say so, this variant does.
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    schemas["CompletionStreamChunk"] = chunk
    return schemas


@lru_cache(maxsize=None)
def _validator(name: str) -> Draft202012Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": {"schemas": _schemas()}}
    return Draft202012Validator(root)


def schema_errors(obj: Any, name: str) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(name).iter_errors(obj)]


def assert_valid(obj: Any, name: str) -> None:
    errors = schema_errors(obj, name)
    assert not errors, f"{name} violations: {errors[:5]}\nin {json.dumps(obj)[:2000]}"
