"""The assistant message of a chat choice: reasoning apart (--reasoning-parser), tool calls parsed
(forced by tool_choice, or found by --tool-call-parser), whole or as stream deltas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.reasoning import ReasoningSplitter, split_reasoning
from server.structured_request import ToolMode
from server.tool_parsers import ToolCallStream, extract_tool_calls


@dataclass(frozen=True)
class ChatOutputFormat:
    tools: ToolMode
    tool_parser: str | None          # --tool-call-parser (only used with tool_choice "auto")
    in_reasoning: bool | None        # None: no --reasoning-parser; else whether the output starts inside it

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole message of a finished choice, and its finish_reason ("tool_calls" when it called)."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.in_reasoning is not None:
            reasoning, text = split_reasoning(text, self.in_reasoning)
            message["content"] = text
            message["reasoning_content"] = message["reasoning"] = reasoning
        if self.tools.kind != "none":
            content, calls = extract_tool_calls(self.tools.kind, text, self.tools.name, self.tool_parser)
            message["content"] = content
            if calls:
                message["tool_calls"] = [c.to_dict() for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def stream(self) -> ChatDeltaStream:
        return ChatDeltaStream(self)


def _merge_by_index(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call in a chunk: a call's header and argument fragments of the same update join."""
    merged: list[dict[str, Any]] = []
    for call in calls:
        if merged and merged[-1]["index"] == call["index"]:
            last = merged[-1]["function"]
            last["arguments"] = last.get("arguments", "") + call["function"].get("arguments", "")
        else:
            merged.append({**call, "function": dict(call["function"])})
    return merged


class ChatDeltaStream:
    """One choice's text deltas -> `delta` objects (content, reasoning_content/reasoning, tool_calls)."""

    def __init__(self, fmt: ChatOutputFormat) -> None:
        self.fmt = fmt
        self.reasoning = ReasoningSplitter(fmt.in_reasoning) if fmt.in_reasoning is not None else None
        self.tools = ToolCallStream(fmt.tools.kind, fmt.tools.name, fmt.tool_parser) if fmt.tools.kind != "none" else None

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if finished and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                content += self.tools.flush()
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _merge_by_index(calls)
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.tools is not None and self.tools.has_calls:
            return "tool_calls"
        return reason
