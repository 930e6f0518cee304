"""response_format, vLLM's structured_outputs, tools / tool_choice (and the legacy functions / function_call):
their request models, and how one request's choice becomes the engine's StructuredOutputs constraint.

How tool calls are constrained (vLLM's shapes): a named tool_choice makes the whole output the arguments
object, valid against that tool's `parameters`; "required" makes it a JSON array of
{"name": <a tool>, "parameters": {...}} objects (one, unless parallel_tool_calls). "auto" is free text that
a --tool-call-parser reads afterwards.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from engine.structured import StructuredOutputs
from engine.structured.grammar import check_schema

MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_OPEN_OBJECT: dict[str, Any] = {"type": "object"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(_Model):
    name: StrictStr = Field(max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's extra field: one of json (a schema), regex, choice, grammar (EBNF), json_object."""
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(_Model):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolMode:
    """What the chat view does with the output: nothing, parse a forced call, or run the auto parser."""
    kind: Literal["none", "named", "required", "auto"] = "none"
    name: str | None = None            # the named tool


def response_format_constraint(fmt: ResponseFormat | None) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None:
        raise ValueError("response_format of type json_schema needs a json_schema object with a name and a schema.")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else _OPEN_OBJECT
    return StructuredOutputs(json=json.dumps(schema))


def structured_outputs_constraint(so: StructuredOutputsRequest | None) -> StructuredOutputs | None:
    if so is None:
        return None
    schema = so.json_
    return StructuredOutputs(json=schema if isinstance(schema, str) or schema is None else json.dumps(schema),
                             regex=so.regex, choice=so.choice, grammar=so.grammar,
                             json_object=bool(so.json_object))


def single_constraint(**constraints: StructuredOutputs | None) -> StructuredOutputs | None:
    given = {name: c for name, c in constraints.items() if c is not None}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each constrain the output; send only one of them.")
    return next(iter(given.values()), None)


def legacy_functions(functions: list[FunctionDefinition] | None, function_call: Any) -> tuple[list[Tool] | None, Any]:
    """The deprecated `functions` / `function_call` as `tools` / `tool_choice`."""
    tools = [Tool(function=f) for f in functions] if functions is not None else None
    if function_call is None or function_call in ("none", "auto"):
        return tools, function_call
    if isinstance(function_call, dict) and isinstance(function_call.get("name"), str):
        return tools, NamedToolChoice(function=FunctionName(name=function_call["name"]))
    raise ValueError('function_call must be "none", "auto" or {"name": "<function name>"}.')


def check_tools(tools: list[Tool]) -> None:
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools per request, got {len(tools)}.")
    seen = set()
    for tool in tools:
        name = tool.function.name
        if not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"tool name {name!r} must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -.")
        if name in seen:
            raise ValueError(f"tool name {name!r} appears twice in tools.")
        seen.add(name)
        params = tool.function.parameters
        if params is not None:
            try:
                check_schema(params)
            except ValueError as exc:
                raise ValueError(f"tools[{name}].function.parameters: {exc}") from None


def tool_constraint(tools: list[Tool] | None, choice: Any, parallel: bool, auto_enabled: bool,
                    ) -> tuple[StructuredOutputs | None, ToolMode]:
    """The constraint and mode for tools + tool_choice (OpenAI's default: "auto" with tools, else "none")."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools; send the tools the model may call.")
        return None, ToolMode()
    check_tools(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, ToolMode()
    if choice == "auto":
        if not auto_enabled:
            raise ValueError('tool_choice "auto" (the default when tools are given) needs the server started with '
                             '--enable-auto-tool-choice (and --tool-call-parser {hermes,llama3_json} for a model '
                             'whose chat template renders tools itself); or send tool_choice "required", "none" '
                             'or a named function.')
        return None, ToolMode("auto")
    by_name = {t.function.name: t for t in tools}
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": _parameters(tool)},
                  "required": ["name", "parameters"]} for name, tool in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=json.dumps(schema)), ToolMode("required")
    name = choice.function.name
    if name not in by_name:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                         f"({', '.join(by_name)}).")
    return StructuredOutputs(json=json.dumps(_parameters(by_name[name]))), ToolMode("named", name)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _OPEN_OBJECT
