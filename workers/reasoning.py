"""Reasoning models' thinking, apart from their answer (vLLM's `--reasoning-parser`).

DeepSeek-R1 and its distills, QwQ, Qwen3 and SmolLM3 think inside `<think>...</think>` before they
answer. Where the thinking begins depends on the chat template, not the model: DeepSeek-R1's
opens `<think>` in the prompt itself, Qwen3's leaves the model to write it, and Qwen3's
`enable_thinking: false` writes an empty `<think></think>` into the prompt. So the worker reads the
rendered prompt: the output starts inside the reasoning when the prompt's last `<think>` is still
open, and otherwise may open it as its first text. Everything up to `</think>` is reasoning, the
rest the answer; an output that never closes its reasoning (max_tokens) is reasoning only.

A response format or tool call applies to the answer: the grammar lets the reasoning run free up
to `</think>` and holds what follows (workers/structured.py, `OutputFormat.reasoning`), as vLLM's
structured outputs do under a reasoning parser.

Torch-free: the worker splits the output stream; the ingress only forwards the two parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ReasoningParser = Literal["deepseek_r1", "qwen3"]  # vLLM's names; both read <think>...</think> as above
# where an output starts: "open", inside reasoning the prompt opened; "closed", free to open it first
ReasoningStart = Literal["open", "closed"]
PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens, decoded to find its last think tag


def reasoning_start(prompt_tail: str) -> ReasoningStart:
    """Where an output begins, from the end of its rendered prompt."""
    return "open" if prompt_tail.rfind(THINK_OPEN) > prompt_tail.rfind(THINK_CLOSE) else "closed"


def prompt_reasoning_start(prompt_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> ReasoningStart:
    """Where an output of this prompt begins, read from the prompt's last tokens."""
    return reasoning_start(decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))


def reasoning_chars(text: str, start: ReasoningStart) -> int:
    """How much of an output's text is thinking, its tags included (all of it, never closed)."""
    if start == "closed" and not text.lstrip().startswith(THINK_OPEN):
        return 0
    end = text.find(THINK_CLOSE)
    return len(text) if end < 0 else end + len(THINK_CLOSE)


def reasoning_tokens(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str], start: ReasoningStart) -> int:
    """How many of an output's tokens its thinking took: the fewest whose text holds all of it."""
    chars = reasoning_chars(decode(token_ids), start)
    lo, hi = 0, len(token_ids)  # the text of the first hi tokens holds the thinking; of lo, not (unless 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class Parts:
    """New text of an output, as reasoning and as answer."""

    reasoning: str = ""
    content: str = ""


@dataclass
class ReasoningSplit:
    """Splits one output's text deltas into reasoning and answer, holding back only a tail that
    may still become a tag (and blanks that may lead a part: neither part starts with blanks).
    `feed` the deltas, then `finish`; the parts' concatenations are the same however the text
    was cut."""

    start: ReasoningStart
    _state: Literal["before", "reasoning", "content"] = field(init=False)
    _held: str = field(init=False, default="")
    _reasoned: bool = field(init=False, default=False)  # some reasoning text went out
    _answered: bool = field(init=False, default=False)  # some answer text went out

    def __post_init__(self) -> None:
        self._state = "reasoning" if self.start == "open" else "before"

    def feed(self, delta: str) -> Parts:
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        while text:
            if self._state == "before":  # an opening tag, after blanks, or the answer
                head = text.lstrip()
                if head.startswith(THINK_OPEN):
                    self._state, text = "reasoning", head[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(head):  # blanks, or a tag cut short: wait
                    self._held, text = text, ""
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = text.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._lead(text[:end], "reasoning")
                    self._state, text = "content", text[end + len(THINK_CLOSE):]
                    continue
                keep = _tag_prefix_at_end(text, THINK_CLOSE)
                out, self._held, text = text[: len(text) - keep], text[len(text) - keep:], ""
                reasoning += self._lead(out, "reasoning")
            else:
                content += self._lead(text, "content")
                text = ""
        return Parts(reasoning, content)

    def finish(self) -> Parts:
        """What was held back, at the end of the output."""
        held, self._held = self._held, ""
        if self._state == "before":
            self._state = "content"
        if self._state == "reasoning":
            return Parts(reasoning=self._lead(held, "reasoning"))
        return Parts(content=self._lead(held, "content"))

    def _lead(self, text: str, part: Literal["reasoning", "content"]) -> str:
        """`text` of a part, less the blanks before the part's first text."""
        started = self._reasoned if part == "reasoning" else self._answered
        if not started:
            text = text.lstrip()
            if part == "reasoning":
                self._reasoned = bool(text)
            else:
                self._answered = bool(text)
        return text


def split_output(text: str, start: ReasoningStart) -> Parts:
    """A whole output's reasoning and answer (the stream's split, fed at once)."""
    split = ReasoningSplit(start)
    fed, held = split.feed(text), split.finish()
    return Parts(fed.reasoning + held.reasoning, fed.content + held.content)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)
