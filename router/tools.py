"""Tool calls by constrained decoding (OpenAI's `tools` with `tool_choice` "required" or a named
function, as vLLM serves them without a model-specific parser).

A named function: the output is held to the function's `parameters` schema and becomes that
call's `arguments`. "required": the output is held to a JSON array of one or more
`{"name": ..., "parameters": {...}}` objects, one schema per tool (`parallel_tool_calls: false`:
exactly one), and each element becomes a call. The grammar does the work, so every drafter stays
lossless (workers/structured.py) and a call always parses, unless max_tokens cut it short.
"auto" needs a parser for the model's own tool-call syntax, which this server does not have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.structured import OutputFormat

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


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
    schema) when `name` is None."""

    tools: dict[str, dict[str, Any]]
    name: str | None = None
    parallel: bool = True

    @property
    def output_format(self) -> OutputFormat:
        if self.name is not None:
            return OutputFormat.json_schema(self.tools[self.name])
        one_of = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                   "required": ["name", "parameters"], "additionalProperties": False}
                  for name, schema in self.tools.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            array["maxItems"] = 1
        return OutputFormat.json_schema(array)

    def answer(self, text: str, finish_reason: str) -> Answer:
        """The message of an output held to `output_format` that ended with `finish_reason`."""
        if self.name is not None:  # the arguments as written, cut short or not (OpenAI's "length")
            return Answer([Call(self.name, text)], None, finish_reason)
        try:
            calls = [Call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # max_tokens ended the array early
            return Answer(None, text, finish_reason)
        return Answer(calls, None, "tool_calls" if finish_reason == "stop" else finish_reason)
