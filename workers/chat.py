"""Chat prompts for templates that do not render tools.

A chat template that knows tools (Qwen's, Llama 3's, Hermes') writes the request's tool
definitions into the prompt itself. One that does not (SmolLM2's) would leave the model unaware
of them, while the output is held to their calls' schemas (router/tools.py): the definitions then
go into the system message, as llama.cpp's generic tool-call handling does, and an assistant's
earlier calls into its text, written as the model writes calls: the generic JSON under "auto", or
Hermes' `<tool_call>` blocks where the target's parser is hermes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from workers.config import ToolCallParser

TOOLS_INTRO = "You can call these tools (their parameters as JSON Schema):"
HERMES_HOW = ('To call a tool, write <tool_call>\n{"name": <the tool\'s name>, "arguments": <its arguments as a '
              "JSON object>}\n</tool_call> for each call.")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"


def calls_text(calls: Sequence[Mapping[str, Any]], parser: ToolCallParser = "generic") -> str:
    """Calls (a template message's `tool_calls`) as the model writes them (router/tools.py):
    generic, `{"tool_calls": [{"name": ..., "parameters": {...}}]}` (an output under "auto");
    hermes, a `<tool_call>` block each."""
    if parser == "hermes":
        return "\n".join(HERMES_OPEN + json.dumps({"name": c["function"]["name"], "arguments": c["function"][
            "arguments"]}) + HERMES_CLOSE for c in calls)
    return json.dumps({"tool_calls": [{"name": c["function"]["name"], "parameters": c["function"]["arguments"]}
                                      for c in calls]})


def with_tools_described(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                         parser: ToolCallParser = "generic") -> list[dict[str, Any]]:
    """`messages` with OpenAI's tool definitions listed in their system message (a new first one
    where there is none) and each assistant's calls in its text."""
    how = [HERMES_HOW] if parser == "hermes" else []
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
