"""Tool calls by constrained decoding (OpenAI's `tools` with any `tool_choice`), for any model: no
parser of a model's own tool-call syntax is needed.

A named function: the output is held to the function's `parameters` schema and becomes that
call's `arguments`. "required": the output is held to a JSON array of one or more
`{"name": ..., "parameters": {...}}` objects, one schema per tool (`parallel_tool_calls: false`:
exactly one), and each element becomes a call. "auto" (the default with tools): the output is
`{"tool_calls": [...]}` with that array, or `{"response": "..."}`, the model's answer, which
becomes the message's content and streams as it is written (llama.cpp's generic tool calls).
The grammar does the work, so every drafter stays lossless (workers/structured.py) and a call
always parses, unless max_tokens cut it short.

A target whose parser is hermes (`target.tool_call_parser`: Qwen 2.5 and 3, Hermes, SmolLM3) writes
calls its own way, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`: a named function
and "required" hold the output to such blocks (a Lark grammar around each call's schema); under
"auto" the model writes freely, as vLLM's hermes parser lets it, and the blocks it wrote become the
calls, the text before them the content (streamed up to where a block may begin).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from workers.chat import HERMES_CLOSE, HERMES_OPEN
from workers.config import ToolCallParser
from workers.structured import JSON_STYLE, OutputFormat

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted
_RESPONSE_OPEN = '{"response": "'  # how an "auto" answer starts (JSON as json.dumps writes it)
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN.strip()) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE.strip()), re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Answer:
    """A choice's message: the calls it made, or (a call max_tokens cut short of parsing) its text."""

    calls: list[Call] | None
    content: str | None
    finish_reason: str


@dataclass(frozen=True)
class ToolChoice:
    """The calls a request asks for: one function by `name`, or any of `tools` (name -> parameters
    schema) when `name` is None, where `auto` lets the model answer instead."""

    tools: dict[str, dict[str, Any]]
    name: str | None = None
    parallel: bool = True
    auto: bool = False
    parser: ToolCallParser = "generic"  # how the target writes calls

    @property
    def output_format(self) -> OutputFormat | None:
        """What the output is held to (None: nothing, hermes under "auto")."""
        if self.parser == "hermes":
            return None if self.auto else self._hermes_format()
        if self.name is not None:
            return OutputFormat.json_schema(self.tools[self.name])
        one_of = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, schema in self.tools.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            array["maxItems"] = 1
        if not self.auto:
            return OutputFormat.json_schema(array)
        return OutputFormat.json_schema({"anyOf": [
            {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
             "additionalProperties": False},
            {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False},
        ]})

    def _hermes_format(self) -> OutputFormat:
        """One `<tool_call>` block (more, one per line, with parallel calls), each holding
        `{"name": ..., "arguments": ...}` of one tool (the named one's)."""
        names = [self.name] if self.name is not None else list(self.tools)
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": self.tools[name]},
                           "required": ["name", "arguments"], "additionalProperties": False} for name in names],
                "x-guidance": JSON_STYLE}
        more = ' ("\\n" call)*' if self.parallel and self.name is None else ""
        return OutputFormat("grammar", f"start: call{more}\n"
                                       f"call: {json.dumps(HERMES_OPEN)} body {json.dumps(HERMES_CLOSE)}\n"
                                       f"body: %json {json.dumps(call)}\n")

    def answer(self, text: str, finish_reason: str) -> Answer:
        """The message of an output held to `output_format` that ended with `finish_reason`."""
        if self.parser == "hermes":
            return self._hermes_answer(text, finish_reason)
        if self.name is not None:  # the arguments as written, cut short or not (OpenAI's "length")
            return Answer([Call(self.name, text)], None, finish_reason)
        try:
            value = json.loads(text)
            if self.auto:
                if "response" in value:
                    return Answer(None, value["response"], finish_reason)
                value = value["tool_calls"]
            calls = [Call(c["name"], json.dumps(c["parameters"])) for c in value]
        except (ValueError, TypeError, KeyError):  # max_tokens ended the JSON early
            content = self.streamed_content(text)
            return Answer(None, text if not content else content, finish_reason)
        return Answer(calls, None, "tool_calls" if finish_reason == "stop" else finish_reason)

    def _hermes_answer(self, text: str, finish_reason: str) -> Answer:
        """The `<tool_call>` blocks as calls, the text before the first as content (None if
        empty); an output whose blocks do not all parse as calls of the tools is content only."""
        start = text.find(HERMES_OPEN.strip())
        if start < 0:
            return Answer(None, text, finish_reason)
        try:
            calls = []
            for body in _HERMES_BLOCK.findall(text):
                call = json.loads(body)
                if call["name"] not in self.tools or not isinstance(call["arguments"], dict):
                    raise ValueError(f"not a call of a tool: {body}")
                calls.append(Call(call["name"], json.dumps(call["arguments"])))
        except (ValueError, TypeError, KeyError):
            calls = []
        if not calls:  # a block max_tokens cut short, or not a call: the text as it is
            return Answer(None, text, finish_reason)
        finish = "stop" if self.name is not None else "tool_calls"
        return Answer(calls if self.parallel else calls[:1], text[:start] or None,
                      finish if finish_reason == "stop" else finish_reason)

    def streamed_content(self, text: str) -> str | None:
        """What of an output so far may stream as the message's content: under "auto", while it
        is an answer (`{"response": "...`), the answer's text as far as it decodes whole ("" while
        the output may still become one); None where it is calls (they go out whole, at the end).
        Hermes under "auto": the text before a `<tool_call>`, less a tail that may begin one."""
        if self.parser == "hermes":
            if not self.auto:
                return None
            opener = HERMES_OPEN.strip()
            if (start := text.find(opener)) >= 0:
                return text[:start]
            held = max((n for n in range(1, len(opener)) if text.endswith(opener[:n])), default=0)
            return text[: len(text) - held]
        if not self.auto or not (text.startswith(_RESPONSE_OPEN) or _RESPONSE_OPEN.startswith(text)):
            return None
        return json_string_prefix(text[len(_RESPONSE_OPEN):])


def json_string_prefix(body: str) -> str:
    """The text of a JSON string so far, `body` being what follows its opening quote: up to its
    closing quote or its last whole character (an escape cut short, or a high surrogate without
    its pair, waits for the rest)."""
    end, i = len(body), 0
    while i < end and body[i] != '"':
        step = 1
        if body[i] == "\\":
            step = 6 if body[i + 1 : i + 2] == "u" else 2
            if body[i + 1 : i + 2] == "u" and 0xD800 <= int(body[i + 2 : i + 6].ljust(4, "0"), 16) <= 0xDBFF:
                step = 12  # a surrogate pair: \uD8xx\uDCxx
            if i + step > end:
                break
        i += step
    return json.loads(f'"{body[:i]}"')
