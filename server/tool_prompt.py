"""Tools for chat templates that drop them.

Many templates (SmolLM2's among them) render only the messages: a request's tools would never reach the model.
At startup the server renders the template once with a probe tool; when the probe's name does not appear, it
lists a request's tools itself, in a system message (merged into the client's own system message when there is
one) that asks for hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls, and reads
them back with the hermes parser. Earlier tool calls in the conversation are written in that same form, so
the model sees what it called.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import jinja2

from server.protocol import ChatMessage

log = logging.getLogger("pagedserve.server")

INJECTED_TOOL_PARSER = "hermes"
_PROBE_NAME = "pagedserve_probe_tool"
_PROBE = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                            "parameters": {"type": "object", "properties": {}}}}]
_SYSTEM_ROLES = ("system", "developer")


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes a request's tools into the prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=_PROBE, tokenize=False,
                                             add_generation_prompt=True)
    except (jinja2.TemplateError, TypeError, ValueError):
        return False
    return _PROBE_NAME in text


def detect_tool_support(tokenizer: Any) -> bool:
    """True when the server must list tools itself (logged once at startup, either way)."""
    if template_renders_tools(tokenizer):
        log.info("chat template renders tools: requests' tools reach the model through it")
        return False
    log.info("chat template drops tools: pagedserve lists them in a system message and reads "
             "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> calls (the hermes format)")
    return True


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return ("You can call functions. Their JSON schemas:\n<tools>\n" + schemas + "\n</tools>\n"
            "To call a function, reply with one <tool_call></tool_call> block per call, each holding a JSON "
            "object with the function's name and its arguments:\n"
            '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>')


def with_tool_prompt(messages: list[ChatMessage], tools: list[dict[str, Any]]) -> list[ChatMessage]:
    """The conversation with the tools listed in its system message, and earlier calls written as text."""
    prompt = tool_system_prompt(tools)
    messages = [_calls_as_text(m) for m in messages]
    if messages and messages[0].role in _SYSTEM_ROLES:
        first = messages[0]
        own = first.for_template()["content"]
        merged = ChatMessage(role=first.role, content=f"{own}\n\n{prompt}" if own else prompt)
        return [merged, *messages[1:]]
    return [ChatMessage(role="system", content=prompt), *messages]


def _calls_as_text(message: ChatMessage) -> ChatMessage:
    """An assistant turn's tool_calls, which such a template would drop, as <tool_call> blocks in its text."""
    calls = (message.model_extra or {}).get("tool_calls")
    if message.role != "assistant" or not calls:
        return message
    rendered = message.for_template()     # checks each call, parses its arguments
    blocks = [_call_block(c["function"]["name"], c["function"]["arguments"]) for c in rendered["tool_calls"]]
    text = "\n".join(part for part in (rendered["content"], *blocks) if part)
    return ChatMessage(role="assistant", content=text)


def _call_block(name: str, arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"
