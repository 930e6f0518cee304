"""A chat choice's output in Anthropic's shapes: the whole message's content blocks and stop_reason, and the
stream's events (content_block_start / _delta / _stop between message_start and message_stop).

The chat path has already read the output (server/chat_output.py: reasoning split off, tool calls parsed);
this only renders its message and deltas as blocks. A tool call's id `call_<hex>` becomes `toolu_<hex>`.
"""
from __future__ import annotations

from typing import Any

from pydantic_core import from_json

from server.sse import dumps


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and its stop_reason (the stop string matched,
    or the stop token's id). An aborted choice (--request-timeout in a stream) ends its turn."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """The arguments object; cut short by max_tokens, what of it was written (as the anthropic SDK's stream
    reader parses partial JSON), or {} when nothing of an object was."""
    try:
        value = from_json(arguments, allow_partial=True) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The blocks of a whole chat message: its reasoning (--reasoning-parser), its text, its tool calls."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
                       "input": tool_input(function["arguments"])})
    return blocks


def sse(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class BlockEvents:
    """One message's chat deltas (server/chat_output.ChatDeltaStream) -> content block events: a block
    starts when output of another kind begins, and stops before the next one starts or at the end."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None        # the type of the block being written

    def delta(self, delta: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            self._ensure(out, {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            self._ensure(out, {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if "id" in call:        # a call's first delta: a block of its own
                self._start(out, {"type": "tool_use", "id": tool_use_id(call["id"]),
                                  "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return b"".join(out)

    def finish(self, reason: str, sequence: str | None, output_tokens: int) -> bytes:
        out: list[bytes] = []
        self._stop(out)
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": {"output_tokens": output_tokens}}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def _ensure(self, out: list[bytes], block: dict[str, Any]) -> None:
        if self.open != block["type"]:
            self._start(out, block)

    def _start(self, out: list[bytes], block: dict[str, Any]) -> None:
        self._stop(out)
        self.index += 1
        self.open = block["type"]
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))

    def _stop(self, out: list[bytes]) -> None:
        if self.open is not None:
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
