"""A chat choice's output in the Responses API's shapes: output items (reasoning, message, function_call) of a
whole answer, and the stream's typed events, each with its sequence_number.

The chat path has already read the output (server/chat_output.py: reasoning split off, tool calls parsed);
this only renders its message and deltas as items. A tool call's id `call_<hex>` is the item's call_id, and
`fc_<hex>` its id.
"""
from __future__ import annotations

from typing import Any

from server.context import response_id
from server.sse import dumps


def new_id(prefix: str) -> str:
    """An item id as OpenAI's look: prefix_<hex>."""
    return response_id(prefix).replace("-", "_", 1)


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text is not None else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """The items of a whole chat message: its reasoning (--reasoning-parser), its text, its tool calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], status))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(function_call_item(call["id"], function["name"], function["arguments"], status))
    return items


def named_event(data: dict[str, Any]) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + dumps(data) + b"\n\n"


class ItemEvents:
    """One answer's chat deltas (server/chat_output.ChatDeltaStream) -> output item events: an item starts
    when output of another kind begins (each tool call is an item of its own), and is done before the next
    one starts or at the end. Every event gets the next sequence_number; `items` are the items written."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None     # the item being written
        self.text = ""                              # its text (or arguments) so far

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(data)

    def delta(self, delta: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            self._ensure(out, "reasoning")
            out.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            self._ensure(out, "message")
            out.append(self._text_delta("response.output_text.delta", delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or ():
            if "id" in call:        # a call's first delta: an item of its own
                self._start(out, function_call_item(call["id"], call["function"]["name"], "", "in_progress"))
            if call["function"].get("arguments"):
                self.text += call["function"]["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, delta=call["function"]["arguments"]))
        return b"".join(out)

    def finish(self, status: str) -> bytes:
        """The open item done, with `status` (incomplete when the answer was cut short)."""
        out: list[bytes] = []
        self._done(out, status)
        return b"".join(out)

    def _text_delta(self, kind: str, text: str, **extra: Any) -> bytes:
        self.text += text
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                          delta=text, **extra)

    def _ensure(self, out: list[bytes], kind: str) -> None:
        if self.open is None or self.open["type"] != kind:
            make = message_item if kind == "message" else reasoning_item
            self._start(out, make(new_id("msg" if kind == "message" else "rs"), None, "in_progress"))
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=text_part("")))

    def _start(self, out: list[bytes], item: dict[str, Any]) -> None:
        self._done(out, "completed")
        self.open, self.text = item, ""
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))

    def _done(self, out: list[bytes], status: str) -> None:
        item = self.open
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = text_part(self.text)
            out.append(self.event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            done = message_item(item["id"], self.text, status)
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            done = reasoning_item(item["id"], self.text, status)
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=self.text))
            done = function_call_item(item["call_id"], item["name"], self.text, status)
        self.items[-1] = done
        self.open = None
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=done))
