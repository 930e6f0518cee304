"""What one chat request becomes before it reaches the engine: its prompt (tools and chat_template_kwargs
rendered by the template), its output constraint, and how its output is read back (ChatOutputFormat)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.structured import StructuredOutputs
from server.chat_output import ChatOutputFormat
from server.chat_template import render_chat_text
from server.protocol import ChatCompletionRequest
from server.reasoning import THINK_END, reasoning_closed_in_prompt, starts_in_reasoning
from server.structured_request import legacy_functions, tool_constraint
from server.tool_prompt import INJECTED_TOOL_PARSER, with_tool_prompt


@dataclass(frozen=True)
class ChatOptions:
    """The server flags that shape chat output."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    inject_tools: bool = False      # the chat template drops tools: list them in a system message (tool_prompt)

    @property
    def auto_tool_parser(self) -> str | None:
        """How tool_choice "auto" output is read: the format pagedserve asked for when it listed the tools
        itself, else --tool-call-parser's."""
        return INJECTED_TOOL_PARSER if self.inject_tools else self.tool_call_parser


@dataclass
class ChatPlan:
    prompt: list[int]
    constraint: StructuredOutputs | None
    output: ChatOutputFormat


def plan_chat(body: ChatCompletionRequest, tokenizer: Any, options: ChatOptions,
              check_prompt: Callable[[str, str], None] | None = None) -> ChatPlan:
    """check_prompt(text, field) may refuse the rendered prompt before it is tokenized (a text too long for
    the context); the server runs this in its tokenizer thread when the request is big."""
    tools, choice = body.tools, body.tool_choice
    if body.functions is not None or body.function_call is not None:
        tools, choice = legacy_functions(body.functions, body.function_call)
        tools = tools if tools is not None else body.tools
    auto_ok = options.enable_auto_tool_choice and options.auto_tool_parser is not None
    tool_so, mode = tool_constraint(tools, choice, body.parallel_tool_calls, auto_ok)
    constraint = body.constraint(tool_choice=tool_so)
    rendered = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    messages = body.messages
    if options.inject_tools and rendered and mode.kind != "none":
        messages, rendered = with_tool_prompt(messages, rendered), None
    text = render_chat_text(tokenizer, messages, body.add_generation_prompt, rendered, body.chat_template_kwargs)
    if check_prompt is not None:
        check_prompt(text, "messages")
    in_reasoning = None
    if options.reasoning_parser is not None:
        in_reasoning = starts_in_reasoning(options.reasoning_parser, text)
        if constraint is not None and not reasoning_closed_in_prompt(text):
            # The model thinks first: the constraint starts after it wrote </think>.
            constraint = replace(constraint, enable_after=tokenizer.encode(THINK_END, add_special_tokens=False))
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ChatPlan(prompt, constraint, ChatOutputFormat(mode, options.auto_tool_parser, in_reasoning))
