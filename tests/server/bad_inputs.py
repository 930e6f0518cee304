"""The bad-input table of tests/server/test_errors.py: every entry must get a 4xx in the OpenAI error envelope.

Fields are merged into a small valid request, so each case breaks exactly one thing. The server under test has
max_model_len 256, 32 sequences (an 8192-token KV cache) and a 64 KiB body limit.
"""
from __future__ import annotations

BAD_COMPLETIONS = {
    # types
    "temperature is a string": {"temperature": "hot"},
    "temperature is a numeric string": {"temperature": "0.5"},
    "temperature is a bool": {"temperature": True},
    "n is a string": {"n": "2"},
    "max_tokens is a float": {"max_tokens": 2.5},
    "stream is a string": {"stream": "yes"},
    "echo is a number": {"echo": 1},
    "model is a number": {"model": 5},
    "prompt of the wrong type": {"prompt": {"text": "hi"}},
    "prompt is a number": {"prompt": 5},
    "prompt is null": {"prompt": None},
    "prompt mixing text and ids": {"prompt": ["a", 5]},
    "token lists nested too deep": {"prompt": [[[1]]]},
    "stop of the wrong type": {"stop": 5},
    "stop list of numbers": {"stop": [1, 2]},
    "logit_bias value not a number": {"logit_bias": {"5": "x"}},
    # ranges
    "temperature below 0": {"temperature": -0.5},
    "top_p above 1": {"top_p": 1.5},
    "top_p is 0": {"top_p": 0},
    "top_k below -1": {"top_k": -2},
    "min_p above 1": {"min_p": 1.5},
    "repetition_penalty is 0": {"repetition_penalty": 0},
    "presence_penalty out of range": {"presence_penalty": 3.0},
    "frequency_penalty out of range": {"frequency_penalty": -3.0},
    "seed beyond int64": {"seed": 2**64},
    "min_tokens negative": {"min_tokens": -1},
    "min_tokens above max_tokens": {"min_tokens": 5},
    # what a request may make the server allocate
    "n is 0": {"n": 0},
    "n too large": {"n": 1000},
    "n x max_tokens beyond the KV cache": {"n": 128, "max_tokens": 200},
    "prompts x n beyond 256 choices": {"prompt": ["a", "b", "c"], "n": 100},
    "too many prompts": {"prompt": ["a"] * 257},
    "max_tokens is 0": {"max_tokens": 0},
    "max_tokens negative": {"max_tokens": -3},
    "max_tokens huge": {"max_tokens": 10**9},
    "max_tokens beyond the context": {"max_tokens": 256},
    "logprobs above 5": {"logprobs": 6},
    "logprobs negative": {"logprobs": -1},
    "logprobs huge": {"logprobs": 10**6},
    "too many stop strings": {"stop": [f"s{i}" for i in range(40)]},
    "stop string too long": {"stop": "x" * 257},
    "empty stop string": {"stop": [""]},
    "too many stop_token_ids": {"stop_token_ids": list(range(300))},
    "negative stop_token_id": {"stop_token_ids": [-1]},
    "stop_token_ids out of vocabulary": {"stop_token_ids": [10_000_000]},
    "logit_bias key not a token id": {"logit_bias": {"abc": 1}},
    "logit_bias key negative": {"logit_bias": {"-5": 1}},
    "logit_bias key out of vocabulary": {"logit_bias": {"10000000": 1}},
    "logit_bias value out of range": {"logit_bias": {"5": 500}},
    "logit_bias value below -100": {"logit_bias": {"5": -101}},
    "logit_bias too large": {"logit_bias": {str(i): 1 for i in range(1100)}},
    # prompts
    "empty prompt": {"prompt": ""},
    "empty prompt list": {"prompt": []},
    "empty string in a prompt list": {"prompt": ["a", ""]},
    "empty token prompt": {"prompt": [[]]},
    "token id out of vocabulary": {"prompt": [10_000_000]},
    "echo of a token id out of vocabulary": {"prompt": [10_000_000], "echo": True},
    "negative token id": {"prompt": [-1]},
    # unsupported
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "best_of other than n": {"best_of": 3},
    "suffix": {"suffix": "x"},
}

BAD_CHATS = {
    "no messages": {"messages": []},
    "messages missing": {"messages": None},
    "messages is an object": {"messages": {"role": "user", "content": "hi"}},
    "message is a string": {"messages": ["hi"]},
    "message without role": {"messages": [{"content": "hi"}]},
    "wrong role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content is a number": {"messages": [{"role": "user", "content": 5}]},
    "text part without text": {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    "image content": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    "max_completion_tokens is 0": {"max_completion_tokens": 0},
    "max_tokens negative beside max_completion_tokens": {"max_tokens": -1},
    "logprobs is a string": {"logprobs": "yes"},
    "top_logprobs without logprobs": {"top_logprobs": 2},
    "top_logprobs above 20": {"logprobs": True, "top_logprobs": 21},
    "top_logprobs negative": {"logprobs": True, "top_logprobs": -1},
    "n too large": {"n": 500},
    "unknown response_format type": {"response_format": {"type": "xml"}},
    "tools with tool_choice auto, server without a parser": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "legacy functions, auto, server without a parser": {"functions": [{"name": "f"}]},
    "tool call turn with arguments that are not JSON": {"messages": [{"role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
    "json_schema response_format, wrongly nested": {"response_format": {"type": "json_schema", "schema": {}}},
}


def _nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 2, "metadata": ' + b"[" * depth + b"]" * depth + b"}"


# (path, raw body): JSON that is not JSON, not UTF-8, not finite, or too deep.
BAD_RAW_BODIES = {
    "NaN temperature": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}'),
    "Infinity top_p": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}'),
    "-Infinity presence_penalty": ("/v1/completions",
                                   b'{"prompt": "hi", "max_tokens": 2, "presence_penalty": -Infinity}'),
    "NaN logit_bias": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}'),
    "NaN chat temperature": ("/v1/chat/completions",
                             b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    "deeply nested arrays": ("/v1/completions", _nested(20_000)),
    "deeply nested objects": ("/v1/completions", b'{"a": ' * 5_000 + b"1" + b"}" * 5_000),
    "invalid UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
    "lone surrogate in the prompt": ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "lone surrogate in a chat message": ("/v1/chat/completions",
                                         b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    "lone surrogate in the model name": ("/v1/completions", b'{"prompt": "hi", "model": "\\ud83d"}'),
    "integer with 5000 digits": ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"),
    "truncated JSON": ("/v1/completions", b'{"prompt": "hi", "max_tok'),
    "empty body": ("/v1/completions", b""),
    "JSON null": ("/v1/completions", b"null"),
    "JSON string": ("/v1/chat/completions", b'"hello"'),
    "tokenize with a lone surrogate": ("/tokenize", b'{"prompt": "\\ud800"}'),
}

BAD_UTILITY = {
    "tokenize with neither prompt nor messages": ("/tokenize", {}),
    "tokenize with both prompt and messages": ("/tokenize", {"prompt": "hi", "messages": [
        {"role": "user", "content": "hi"}]}),
    "tokenize with a wrong role": ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}),
    "detokenize a negative id": ("/detokenize", {"tokens": [-1]}),
    "detokenize an id out of vocabulary": ("/detokenize", {"tokens": [10_000_000]}),
    "detokenize tokens not a list": ("/detokenize", {"tokens": "1 2 3"}),
}
