"""--reasoning-parser: the model's thinking, between <think> and </think>, apart from its answer.

Whether an output starts inside the reasoning depends on the prompt: Qwen3's template leaves `<think>`
for the model to write (or, with enable_thinking false, closes an empty block itself); DeepSeek-R1's
templates open the block in the prompt, and the parser then assumes the output starts inside it unless
the prompt already closed it. The text is split as it streams: a tag cut across two deltas is held back
until it is whole, so no fragment of `</think>` ever reaches content.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def starts_in_reasoning(parser: str, prompt_text: str) -> bool:
    opened, closed = prompt_text.rfind(THINK_START), prompt_text.rfind(THINK_END)
    if opened > closed:
        return True                       # the prompt opened a block it did not close
    return parser == "deepseek_r1" and closed < 0


@dataclass
class ReasoningSplitter:
    """Feeds on text deltas; returns (reasoning, content) pieces of each."""
    in_reasoning: bool
    _held: str = ""
    _seen_text: bool = False

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning, content = [], []
        while text:
            tag = THINK_END if self.in_reasoning else THINK_START
            at = text.find(tag)
            if at < 0:
                keep = partial_tag_len(text, tag)
                if not self.in_reasoning and (self._seen_text or text[:len(text) - keep].strip()):
                    keep = 0       # <think> only opens reasoning at the very start of the output
                piece, self._held = text[:len(text) - keep], text[len(text) - keep:]
                (reasoning if self.in_reasoning else content).append(piece)
                self._seen_text = self._seen_text or bool(piece.strip())
                break
            if not self.in_reasoning and (self._seen_text or text[:at].strip()):
                content.append(text)               # a <think> in the middle of an answer is just text
                self._seen_text = True
                break
            (reasoning if self.in_reasoning else content).append(text[:at])
            self.in_reasoning = not self.in_reasoning
            text = text[at + len(tag):]
            if not self.in_reasoning:
                text = text.lstrip("\n")               # the newline(s) after </think> separate, not answer
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """Whole-output split: (reasoning or None when there was none, content)."""
    splitter = ReasoningSplitter(in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    reasoning = r1 + r2
    return (reasoning if reasoning or in_reasoning or THINK_START in text else None), c1 + c2


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def reasoning_closed_in_prompt(prompt_text: str) -> bool:
    """The prompt already ended the reasoning (e.g. Qwen3 with enable_thinking false): no reasoning to skip."""
    return prompt_text.rfind(THINK_END) > prompt_text.rfind(THINK_START)
