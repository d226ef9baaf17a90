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

A target with a parser of its own (`target.tool_call_parser`, workers/chat.py `CallSyntax`) writes
calls its own way: hermes (Qwen 2.5 and 3, Hermes, SmolLM3) as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, llama3_json (Llama 3.1-3.3)
as bare `{"name": ..., "parameters": {...}}` objects separated by "; ". A named function and
"required" hold the output to such calls (a Lark grammar around each call's schema); under "auto"
the model writes freely, as vLLM's parsers let it, and the calls it wrote become `tool_calls`, the
text before them (hermes) the content, streamed up to where a call may begin.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from workers.chat import SYNTAXES, CallSyntax
from workers.config import ToolCallParser
from workers.structured import JSON_STYLE, OutputFormat

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted
_RESPONSE_OPEN = '{"response": "'  # how an "auto" answer starts (JSON as json.dumps writes it)


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
    def syntax(self) -> CallSyntax | None:
        """The target's own call syntax; None: the generic JSON any model is held to."""
        return SYNTAXES.get(self.parser)

    @property
    def output_format(self) -> OutputFormat | None:
        """What the output is held to (None: nothing, a parser's syntax under "auto")."""
        if (syntax := self.syntax) is not None:
            return None if self.auto else self._syntax_format(syntax)
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

    def _syntax_format(self, syntax: CallSyntax) -> OutputFormat:
        """One call in the syntax (more, separated as it separates them, with parallel calls), each
        `{"name": ..., ARGUMENTS: ...}` of one tool (the named one's)."""
        names = [self.name] if self.name is not None else list(self.tools)
        key = syntax.arguments
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, key: self.tools[name]},
                           "required": ["name", key], "additionalProperties": False} for name in names],
                "x-guidance": JSON_STYLE}
        more = f" ({json.dumps(syntax.separator)} call)*" if self.parallel and self.name is None else ""
        parts = [json.dumps(syntax.opener)] * bool(syntax.opener) + ["body"] + [json.dumps(syntax.closer)] * bool(
            syntax.closer)
        return OutputFormat("grammar", f"start: call{more}\ncall: {' '.join(parts)}\nbody: %json {json.dumps(call)}\n")

    def answer(self, text: str, finish_reason: str) -> Answer:
        """The message of an output held to `output_format` that ended with `finish_reason`."""
        if (syntax := self.syntax) is not None:
            return self._syntax_answer(syntax, text, finish_reason)
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

    def _syntax_answer(self, syntax: CallSyntax, text: str, finish_reason: str) -> Answer:
        """The calls as calls, the text before the first as content (None if empty); an output
        whose calls do not all parse as calls of the tools is content only."""
        start = _calls_start(syntax, text)
        try:
            calls = [] if start is None else [self._call(syntax, c) for c in _read_calls(syntax, text[start:])]
        except (ValueError, TypeError, KeyError):
            calls = []
        if start is None or not calls:  # a call max_tokens cut short, or not a call: the text as it is
            return Answer(None, text, finish_reason)
        finish = "stop" if self.name is not None else "tool_calls"
        return Answer(calls if self.parallel else calls[:1], text[:start] or None,
                      finish if finish_reason == "stop" else finish_reason)

    def _call(self, syntax: CallSyntax, value: Any) -> Call:
        """A parsed call of one of the tools (its arguments under the syntax's key; "arguments"
        and "parameters" are both read, as vLLM reads them)."""
        arguments = value.get(syntax.arguments, value.get("arguments", value.get("parameters")))
        if value["name"] not in self.tools or not isinstance(arguments, dict):
            raise ValueError(f"not a call of a tool: {value}")
        return Call(value["name"], json.dumps(arguments))

    def streamed_content(self, text: str) -> str | None:
        """What of an output so far may stream as the message's content: under "auto", while it
        is an answer (`{"response": "...`), the answer's text as far as it decodes whole ("" while
        the output may still become one); None where it is calls (they go out whole, at the end).
        A parser's syntax under "auto": the text before its first call, less a tail that may begin
        one (hermes); nothing while the output may be calls (llama3_json: it starts with "{")."""
        if (syntax := self.syntax) is not None:
            if not self.auto:
                return None
            if (start := _calls_start(syntax, text)) is not None:
                return text[:start]
            if not syntax.opener:
                return "" if not text.strip() else text
            opener = syntax.opener.strip()
            held = max((n for n in range(1, len(opener)) if text.endswith(opener[:n])), default=0)
            return text[: len(text) - held]
        if not self.auto or not (text.startswith(_RESPONSE_OPEN) or _RESPONSE_OPEN.startswith(text)):
            return None
        return json_string_prefix(text[len(_RESPONSE_OPEN):])


def _calls_start(syntax: CallSyntax, text: str) -> int | None:
    """Where an output's calls begin: its first opener, or (a syntax without one, whose output is
    calls or text) its first character when that opens a JSON object; None: no calls."""
    if syntax.opener:
        start = text.find(syntax.opener.strip())
        return None if start < 0 else start
    return 0 if text.lstrip().startswith("{") else None


def _read_calls(syntax: CallSyntax, text: str) -> list[Any]:
    """The calls' JSON values in `text` (from where they begin). With an opener: every whole
    block, whatever lies between (a block max_tokens cut short is not one), as vLLM's hermes
    parser reads them; without: values separated by the separator and nothing else (ValueError)."""
    if syntax.opener:
        block = re.escape(syntax.opener.strip()) + r"\s*(.*?)\s*" + re.escape(syntax.closer.strip())
        return [json.loads(body) for body in re.findall(block, text, re.DOTALL)]
    decoder, values, i = json.JSONDecoder(), [], 0
    separator = syntax.separator.strip()
    while True:
        value, i = decoder.raw_decode(text, len(text) - len(text[i:].lstrip()))
        values.append(value)
        rest = text[i:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            raise ValueError(f"not a call, nor {separator!r} before one: {rest[:40]!r}")
        i = len(text) - len(rest) + len(separator)


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
