"""Chat prompts for templates that do not render tools.

A chat template that knows tools (Qwen's, Llama 3's, Hermes') writes the request's tool
definitions into the prompt itself. One that does not (SmolLM2's) would leave the model unaware
of them, while the output is held to their calls' schemas (router/tools.py): the definitions then
go into the system message, as llama.cpp's generic tool-call handling does, and an assistant's
earlier calls into its text, written as the model writes calls: the generic JSON under "auto", or
the syntax of the target's parser (`CallSyntax`: Hermes' `<tool_call>` blocks, Llama 3's bare JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workers.config import ToolCallParser

TOOLS_INTRO = "You can call these tools (their parameters as JSON Schema):"


@dataclass(frozen=True)
class CallSyntax:
    """How a model family writes its tool calls: each `{"name": ..., ARGUMENTS: {...}}` between
    `opener` and `closer`, one after another with `separator` between. Text may come before an
    opener; a syntax without one writes calls or text, never both."""

    arguments: str  # the key of a call's arguments
    opener: str
    closer: str
    separator: str
    how: str  # how to call, for the system message where the template does not render tools

    def write(self, name: str, arguments: Any) -> str:
        return self.opener + json.dumps({"name": name, self.arguments: arguments}) + self.closer


# vLLM's --tool-call-parser names
SYNTAXES: dict[str, CallSyntax] = {
    "hermes": CallSyntax(  # Qwen 2.5 and 3, Hermes, SmolLM3
        "arguments", "<tool_call>\n", "\n</tool_call>", "\n",
        'To call a tool, write <tool_call>\n{"name": <the tool\'s name>, "arguments": <its arguments as a JSON '
        "object>}\n</tool_call> for each call."),
    "llama3_json": CallSyntax(  # Llama 3.1, 3.2 and 3.3
        "parameters", "", "", "; ",
        'To call a tool, respond with only {"name": <the tool\'s name>, "parameters": <its arguments as a JSON '
        "object>}, calls separated by \"; \"."),
}


def calls_text(calls: Sequence[Mapping[str, Any]], parser: ToolCallParser = "generic") -> str:
    """Calls (a template message's `tool_calls`) as the model writes them (router/tools.py):
    generic, `{"tool_calls": [{"name": ..., "parameters": {...}}]}` (an output under "auto");
    otherwise in the parser's syntax."""
    if parser in SYNTAXES:
        syntax = SYNTAXES[parser]
        return syntax.separator.join(syntax.write(c["function"]["name"], c["function"]["arguments"]) for c in calls)
    return json.dumps({"tool_calls": [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]}
                                      for c in calls]})


def with_tools_described(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                         parser: ToolCallParser = "generic") -> list[dict[str, Any]]:
    """`messages` with OpenAI's tool definitions listed in their system message (a new first one
    where there is none) and each assistant's calls in its text."""
    how = [SYNTAXES[parser].how] if parser in SYNTAXES else []
    text = "\n".join([TOOLS_INTRO, *(json.dumps(t.get("function", t)) for t in tools), *how])
    out = [_calls_in_text(m, parser) for m in messages]
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


def _calls_in_text(message: dict[str, Any], parser: ToolCallParser) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = calls_text(message["tool_calls"], parser)
    content = message.get("content")
    return {"role": message["role"], "content": f"{content}\n{calls}" if content else calls}
