"""Chat prompts for templates that do not render tools.

A chat template that knows tools (Qwen's, Llama 3's, Hermes') writes the request's tool
definitions into the prompt itself. One that does not (SmolLM2's) would leave the model unaware
of them, while the output is held to their calls' schemas (router/tools.py): the definitions then
go into the system message, as llama.cpp's generic tool-call handling does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

TOOLS_INTRO = "You can call these tools (their parameters as JSON Schema):"


def with_tools_described(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with OpenAI's tool definitions listed in their system message (a new first one
    where there is none)."""
    text = "\n".join([TOOLS_INTRO, *(json.dumps(t.get("function", t)) for t in tools)])
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
