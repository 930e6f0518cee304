"""Tool calls out of generated text: whole (non-streaming) and as stream deltas.

Formats: a forced call ("required": a JSON array of {"name", "parameters"}; a named tool: the arguments
object alone), and the --tool-call-parser formats for tool_choice "auto": `hermes`
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5 / Qwen3 / Hermes) and `llama3_json`
(`{"name": ..., "parameters": {...}}`, several joined by `;`, optionally after `<|python_tag|>`).
Streamed, the first delta of a call carries its id, type and whole name; later ones argument fragments.
A call's arguments are the JSON text the model wrote, from its first to its last bracket, in both forms, so
the fragments of a stream join into exactly the `arguments` of the whole answer.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.reasoning import partial_tag_len

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# The head of one call object, up to where its arguments value starts.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


@dataclass
class ToolCall:
    name: str
    arguments: str                      # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def extract_tool_calls(kind: str, text: str, name: str | None = None,
                       parser: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; text that holds no well-formed call stays content."""
    if kind == "named":
        return None, [ToolCall(name, text.lstrip())]
    if kind == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []        # cut short (finish_reason "length"): no call to report
        calls = [c for c in map(_call_from_object, items if isinstance(items, list) else []) if c]
        return (None, _as_written(calls, [text])) if calls else (text, [])
    if kind != "auto":
        return text, []
    if parser == "hermes":
        return _extract_hermes(text)
    return _extract_llama3_json(text)


def _as_written(calls: list[ToolCall], texts: list[str]) -> list[ToolCall]:
    """The calls with their arguments as the model wrote them in `texts` (what a stream sends), rather than
    re-serialized; unchanged when the texts do not hold exactly these calls' bracketed arguments."""
    written = []
    for text in texts:
        scanner = _CallScanner()
        scanner.feed(text)
        if scanner.args_from >= 0:
            return calls
        written += [c.arguments for c in scanner.calls]
    if len(written) == len(calls):
        for call, arguments in zip(calls, written):
            call.arguments = arguments
    return calls


def _extract_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    bodies = _HERMES_CALL.findall(text)
    for body in bodies:
        try:
            call = _call_from_object(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[:text.find(_HERMES_START)].strip()
    return content or None, _as_written(calls, bodies)


def _extract_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call_from_object(obj)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return None, _as_written(calls, [body])


class _CallScanner:
    """Finds call objects in a growing text and streams each one's arguments as they are generated."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0                    # where the search for the next call head starts
        self.args_from = -1             # start of the current call's arguments (-1: not inside a call)
        self.emitted = 0                # argument characters of the current call already sent
        self.depth, self.in_string, self.escaped = 0, False, False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        deltas: list[dict[str, Any]] = []
        while True:
            if self.args_from < 0:
                m = _CALL_HEAD.search(self.text, self.pos)
                if m is None:
                    return deltas
                call = ToolCall(json.loads(f'"{m.group(1)}"'), "")
                self.calls.append(call)
                self.args_from = self.emitted = self.pos = m.end()
                self.depth, self.in_string, self.escaped = 0, False, False
                deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            if self.emitted == self.args_from:
                # The arguments start at their first bracket: whitespace before it (the head may have come
                # in a chunk of its own) is not part of them.
                while self.pos < len(self.text) and self.text[self.pos].isspace():
                    self.pos += 1
                self.args_from = self.emitted = self.pos
                if self.pos == len(self.text):
                    return deltas
            end = self._scan_arguments()
            stop = end if end >= 0 else len(self.text)
            if stop > self.emitted:
                piece = self.text[self.emitted:stop]
                self.calls[-1].arguments += piece
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
                self.emitted = stop
            if end < 0:
                return deltas
            self.args_from, self.pos = -1, end

    def _scan_arguments(self) -> int:
        """Advances over the arguments value; its end index once its outermost bracket closed, else -1."""
        text, i = self.text, self.pos
        while i < len(text):
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return -1


class ToolCallStream:
    """One choice's stream: feed(text) -> (content delta, tool_calls deltas)."""

    def __init__(self, kind: str, name: str | None = None, parser: str | None = None) -> None:
        self.kind, self.name, self.parser = kind, name, parser
        self.scanner = _CallScanner()
        self.named: ToolCall | None = None
        self._held = ""
        self._inside = False            # hermes: between <tool_call> and </tool_call>
        self._mode: str | None = None   # llama3_json: "calls" or "content", decided by the first text

    @property
    def has_calls(self) -> bool:
        return self.named is not None or bool(self.scanner.calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.kind == "named":
            return "", self._feed_named(text)
        if self.kind == "required":
            return "", self.scanner.feed(text)
        if self.kind != "auto":
            return text, []
        if self.parser == "hermes":
            return self._feed_hermes(text)
        return self._feed_llama3(text)

    def _feed_named(self, text: str) -> list[dict[str, Any]]:
        if self.named is None:
            text = text.lstrip()      # as extract_tool_calls does: the arguments start at their bracket
            if not text:
                return []
            self.named = ToolCall(self.name, text)
            return [{"index": 0, "id": self.named.id, "type": "function",
                     "function": {"name": self.name, "arguments": text}}]
        if not text:
            return []
        self.named.arguments += text
        return [{"index": 0, "function": {"arguments": text}}]

    def _feed_hermes(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        text, self._held = self._held + text, ""
        content, deltas = [], []
        while text:
            tag = _HERMES_END if self._inside else _HERMES_START
            at = text.find(tag)
            if at < 0:
                keep = partial_tag_len(text, tag)
                body, self._held = text[:len(text) - keep], text[len(text) - keep:]
                if self._inside:
                    deltas += self.scanner.feed(body)
                else:
                    content.append(body)
                break
            if self._inside:
                deltas += self.scanner.feed(text[:at])
                self.scanner.pos = len(self.scanner.text)      # a malformed call does not leak into the next
            else:
                content.append(text[:at])
            self._inside = not self._inside
            text = text[at + len(tag):]
        return ("" if self.scanner.calls else "".join(content)), deltas

    def _feed_llama3(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._mode is None:
            self._held += text
            head = self._held.lstrip()
            if not head or _PYTHON_TAG.startswith(head):
                return "", []
            self._mode = "calls" if head.startswith(("{", _PYTHON_TAG)) else "content"
            text, self._held = self._held, ""
        if self._mode == "content":
            return text, []
        return "", self.scanner.feed(text)

    def flush(self) -> str:
        """Text held back at the end (a partial tag that never completed) is content."""
        held, self._held = self._held, ""
        return "" if self.kind in ("named", "required") else held
