"""StructuredOutputs -> xgrammar Grammar, with the checks and fixes a served grammar needs.

JSON grammars are built compact (", " and ": " separators, no free whitespace: vLLM's
disable_any_whitespace), so that a constrained output cannot run on in whitespace. xgrammar 0.2.8 writes
length-bounded strings (minLength / maxLength) as `[^"\\\r\n]{m,n}`, which lets raw control characters
(U+0000..U+001F) into JSON strings, where JSON forbids them; every negated character class of a JSON
grammar lies inside a string, so each one is made to exclude them too.
"""
from __future__ import annotations

import json
import re

import jsonschema
import xgrammar as xg

from engine.structured.spec import StructuredOutputs

_CONTROL = r"\0-\x1f"
_NEGATED_CLASS = re.compile(r"\[\^(?!\\0-\\x1f)")
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")    # "[13:39:55] /project/cpp/x.cc:83: "


def check_structured(spec: StructuredOutputs) -> None:
    """The door's check (any thread, no tokenizer needed): raises ValueError for a spec that does not parse."""
    build_grammar(spec)


def build_grammar(spec: StructuredOutputs) -> xg.Grammar:
    """Raises ValueError, with the compiler's own message, for anything xgrammar cannot take."""
    form = spec.form
    try:
        if form == "json":
            return json_schema_grammar(parse_schema(spec.json))
        if form == "json_object":
            return json_schema_grammar({"type": "object"})
        if form == "regex":
            return xg.Grammar.from_regex(spec.regex)
        if form == "choice":
            return xg.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xg.Grammar.from_ebnf(spec.grammar)
    except RuntimeError as exc:
        raise ValueError(f"invalid {_NAMES[form]}: {compiler_message(exc)}") from None


_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
          "grammar": "grammar (EBNF)"}


def parse_schema(text: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}.") from None
    check_schema(schema)
    return schema


def check_schema(schema: object) -> None:
    """A JSON Schema (draft 2020-12) or ValueError naming what is wrong."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object (or a boolean).")  # noqa: TRY004 (a user error: 400)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from None


def json_schema_grammar(schema: dict | bool) -> xg.Grammar:
    grammar = xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return xg.Grammar.from_ebnf(_exclude_control_chars(str(grammar)))


def _exclude_control_chars(ebnf: str) -> str:
    return _NEGATED_CLASS.sub(lambda _: "[^" + _CONTROL, ebnf)


def compiler_message(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0] if lines else type(exc).__name__)
