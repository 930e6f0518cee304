"""Pydantic models of the OpenAI requests (plus vLLM's extra sampling fields), and their SamplingParams.

Unknown fields are ignored (clients send fields this server has no use for); every range check lives in
SamplingParams so that the HTTP and offline paths refuse the same things with the same message. The ranges
are also written into the JSON schema (`_doc`, documentation only) so that /openapi.json tells clients and
schema fuzzers the truth: whatever it rules out is refused. Numbers are strict: "0.5" is not a float.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.structured import StructuredOutputs
from server.structured_request import (
    FunctionDefinition,
    ResponseFormat,
    StructuredOutputsRequest,
    Tool,
    ToolChoice,
    response_format_constraint,
    single_constraint,
    structured_outputs_constraint,
)

# Completions' `logprobs` is 0..5 in the OpenAI API; chat's `top_logprobs` is 0..20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_BATCH_PROMPTS = 256

# OpenAI's defaults for the fields a model's generation_config.json may override.
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
_TOKEN_ID_KEY = re.compile(r"[0-9]+")
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_LEN}


def _doc(default: Any, **schema: Any) -> Any:
    """A field whose JSON schema states the bounds SamplingParams enforces (pydantic does not check them)."""
    return Field(default, json_schema_extra=schema)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False


class SamplingRequest(OpenAIModel):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str | None = None
    n: StrictInt = _doc(1, minimum=1, maximum=MAX_N)
    temperature: StrictFloat | None = _doc(None, minimum=0, maximum=100)
    top_p: StrictFloat | None = _doc(None, exclusiveMinimum=0, maximum=1)
    presence_penalty: StrictFloat | None = _doc(0.0, minimum=-2, maximum=2)
    frequency_penalty: StrictFloat | None = _doc(0.0, minimum=-2, maximum=2)
    logit_bias: dict[str, StrictFloat] | None = _doc(None, maxProperties=MAX_LOGIT_BIAS,
                                                     propertyNames={"pattern": "^[0-9]+$"},
                                                     additionalProperties={"minimum": -100, "maximum": 100})
    seed: StrictInt | None = _doc(None, minimum=-(2**63), maximum=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = _doc(None, anyOf=[
        _STOP_STRING, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_STRING}, {"type": "null"}])
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: StrictInt | None = _doc(None, minimum=-1)
    min_p: StrictFloat | None = _doc(None, minimum=0, maximum=1)
    repetition_penalty: StrictFloat | None = _doc(None, exclusiveMinimum=0, maximum=100)
    min_tokens: StrictInt = _doc(0, minimum=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = _doc(None, maxItems=MAX_STOP_TOKEN_IDS, items={"type": "integer",
                                                                                         "minimum": 0})
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    prompt_logprobs: StrictInt | None = _doc(None, minimum=0)   # vLLM's: log-probabilities of the prompt tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options may only be set when stream is true.")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true; send stream: false.")

    def constraint(self, **more: StructuredOutputs | None) -> StructuredOutputs | None:
        """The one output constraint of this request, if any (two at once are refused)."""
        return single_constraint(response_format=response_format_constraint(self.response_format),
                                 structured_outputs=structured_outputs_constraint(self.structured_outputs), **more)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, model_defaults: dict[str, Any],
                        structured_outputs: StructuredOutputs | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for this request; fields the client left out come from the model's defaults."""
        chosen = {}
        for name, openai_default in _OPENAI_DEFAULTS.items():
            value = getattr(self, name)
            chosen[name] = value if value is not None else model_defaults.get(name, openai_default)
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=_parse_logit_bias(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=structured_outputs, **chosen)


def _parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    if not all(_TOKEN_ID_KEY.fullmatch(k) for k in bias):
        raise ValueError("logit_bias keys must be token ids written as strings, e.g. {\"50256\": -100}.")
    return {int(k): v for k, v in bias.items()}


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = _doc(16, minimum=0)     # 0: with echo, score the prompt only
    echo: StrictBool = False
    logprobs: StrictInt | None = _doc(None, minimum=0, maximum=MAX_COMPLETION_LOGPROBS)
    best_of: StrictInt | None = None
    suffix: str | None = _doc(None, maxLength=0)

    def validate_request(self) -> None:
        self.check_stream_options()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}.")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise ValueError("best_of other than n is not supported; leave it out and use n.")
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only with echo: true, which returns the prompt, "
                             f"scored with logprobs, without generating); got {self.max_tokens}.")

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives the engine returns for prompt tokens: for prompt_logprobs, and for echo with logprobs
        (the echoed tokens are scored too); echo with max_tokens 0 computes the prompt even unscored."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if not asked and self.echo and self.max_tokens == 0:
            asked = [0]
        return max(asked) if asked else None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) are kept: chat templates may render them.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]     # OpenAI's roles
    content: StrictStr | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = _join_text_parts(self.content)
        # An assistant turn that only calls tools has content null: templates index message['content'].
        message.setdefault("content", "")
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_call_for_template(c) for c in message["tool_calls"]]
        return message


def _call_for_template(call: Any) -> Any:
    """Templates render arguments as an object (`| tojson`); the API carries them as JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        raise ValueError("each tool_calls entry of a message needs function.name and function.arguments "
                         "(JSON text).")
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        raise ValueError(f"tool call arguments must be JSON text, got {function['arguments'][:100]!r}.") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _join_text_parts(parts: list[ContentPart]) -> str:
    texts = []
    for part in parts:
        if part.type != "text" or part.text is None:
            raise ValueError(f"message content parts of type {part.type!r} are not supported; only text.")
        texts.append(part.text)
    return "\n".join(texts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = _doc(None, minimum=1)
    max_completion_tokens: StrictInt | None = _doc(None, minimum=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = _doc(None, minimum=0, maximum=MAX_CHAT_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    functions: list[FunctionDefinition] | None = None     # deprecated spelling of tools
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: StrictBool = False

    def validate_request(self) -> None:
        self.check_stream_options()
        if self.echo:
            raise ValueError("echo is not supported for chat completions; use /v1/completions with echo: true "
                             "(and prompt_logprobs here to score the prompt).")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true.")
            if not 0 <= self.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {self.top_logprobs}.")
        for name in ("max_tokens", "max_completion_tokens"):    # both checked, though one is used
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.functions is not None and self.tools is not None:
            raise ValueError("send tools or the deprecated functions, not both.")
        if self.function_call is not None and self.tool_choice is not None:
            raise ValueError("send tool_choice or the deprecated function_call, not both.")

    @property
    def max_new_tokens(self) -> int | None:
        """None fills the context: the chat default, as in OpenAI's API."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[StrictInt] = _doc(..., items={"type": "integer", "minimum": 0})


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None

    def validate_request(self) -> None:
        if self.dimensions is not None:
            raise ValueError("dimensions is not supported: this model's embeddings always have its full hidden "
                             "size (it was not trained to be shortened); leave dimensions out.")


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def refuse_types(items: Any, allowed: Collection[str], what: str, send: str) -> Any:
    """For a field validator (mode "before"): an item of a `type` not in `allowed` (an image block, a built-in
    tool...) is named in the 400, rather than failing a union with a list of every variant's errors."""
    for item in items if isinstance(items, list) else ():
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise ValueError(f"{what} of type {kind!r} are not supported by this server; send {send}.")
    return items
