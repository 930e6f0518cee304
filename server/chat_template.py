"""Messages (and tools) -> the prompt, through the tokenizer's chat template."""
from __future__ import annotations

from typing import Any

import jinja2

from server.protocol import ChatMessage


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """Chat template -> prompt token ids. The template writes any BOS itself, so no special tokens are added."""
    return tokenizer(render_chat_text(tokenizer, messages, add_generation_prompt), add_special_tokens=False)["input_ids"]


def render_chat_text(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text; tools (OpenAI's shape) and chat_template_kwargs reach the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions instead.")
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "conversation", "tools", "tokenize", "add_generation_prompt", "chat_template"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}; it is a request field of its own.")
    try:
        return tokenizer.apply_chat_template([m.for_template() for m in messages], tokenize=False, tools=tools,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template cannot render these messages: {exc}") from None
