"""The per-token chunk templates encode exactly what the generic (dict) path encodes."""
from __future__ import annotations

import json

import pytest

from server.sse import ChunkFormat

TEXTS = ["", " fox", 'quote " and \\ backslash', "tab\there\nnewline", "你好 🦄", "\u2028\x00\x1f", "</script>"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 7, 123])
def test_text_templates_equal_the_generic_chunks(text: str, index: int) -> None:
    completion = ChunkFormat("cmpl-1", "text_completion", 1700000000, "m/é",
                             text_choice=b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}')
    assert completion.text_event(index, text) == completion.event(
        {"index": index, "text": text, "logprobs": None, "finish_reason": None})
    chat = ChunkFormat("chatcmpl-1", "chat.completion.chunk", 1700000000, "m",
                       text_choice=b'{"index":%d,"delta":{"content":%s},"finish_reason":null}')
    event = chat.text_event(index, text)
    assert event == chat.event({"index": index, "delta": {"content": text}, "finish_reason": None})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["choices"][0]["delta"]["content"] == text
