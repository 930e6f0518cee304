"""The Messages output mapping alone: stop reasons, partial tool input, and block events from chat deltas
(reasoning, text, tool calls) in Anthropic's order."""
from __future__ import annotations

import json

from server.messages_output import BlockEvents, content_blocks, stop_reason, tool_input
from server.messages_protocol import MessagesRequest


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in raw.decode().split("\n\n")[:-1]:
        name, data = chunk.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_stop_reasons() -> None:
    assert stop_reason("stop", None) == ("end_turn", None)
    assert stop_reason("stop", 2) == ("end_turn", None)              # the EOS token's id
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("abort", None) == ("end_turn", None)


def test_tool_input_cut_short() -> None:
    assert tool_input('{"city": "Paris", "days": 3}') == {"city": "Paris", "days": 3}
    assert tool_input('{"city": "Paris", "da') == {"city": "Paris"}
    assert tool_input("") == {} and tool_input("[1, 2]") == {} and tool_input("}{") == {}


def test_blocks_from_deltas_in_order() -> None:
    message = {"role": "assistant", "content": "Hi", "reasoning_content": "hmm",
               "tool_calls": [{"id": "call_ab", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert content_blocks(message) == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                       {"type": "text", "text": "Hi"},
                                       {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {"a": 1}}]
    blocks = BlockEvents()
    raw = b"".join([
        blocks.delta({"reasoning_content": "hm"}), blocks.delta({"reasoning_content": "m", "content": "H"}),
        blocks.delta({"content": "i"}),
        blocks.delta({"tool_calls": [{"index": 0, "id": "call_ab", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]}),
        blocks.delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        blocks.delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}},
                                     {"index": 1, "id": "call_cd", "type": "function",
                                      "function": {"name": "g", "arguments": "{}"}}]}),
        blocks.delta({}), blocks.finish("tool_use", None, 7)])
    names = [(n, d.get("index")) for n, d in _events(raw)]
    assert names == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
                     ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
                     ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
                     ("message_delta", None), ("message_stop", None)]
    events = _events(raw)
    assert events[4][1]["content_block"] == {"type": "text", "text": ""}
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {}}
    assert [d["delta"]["partial_json"] for n, d in events if d.get("index") == 2 and n == "content_block_delta"] \
        == ['{"a": ', "1}"]
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"output_tokens": 7}}


def test_a_conversation_becomes_chat_messages() -> None:
    """Tool results become tool messages, calls tool_calls; earlier thinking stays out (as Anthropic's does)."""
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stop_sequences": ["x"],
        "metadata": {"user_id": "u"},
        "messages": [{"role": "user", "content": "Q"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                       {"type": "text", "text": "Let me see."},
                                                       {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                   "content": [{"type": "text", "text": "boom"}]},
                                                  {"type": "text", "text": "Go on"}]}]})
    chat = body.to_chat()
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "S1\nS2"}, {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "t1"}, {"role": "user", "content": "Go on"}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["x"] and chat.user == "u" and chat.max_tokens == 5 and chat.n == 1
