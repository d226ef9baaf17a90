"""Tool calls for any model (router/tools.py, workers/chat.py): "auto" as calls or an answer under
one grammar, the answer's text streaming as it is written, and tool definitions in the system
message where the chat template does not render them."""

from __future__ import annotations

import json

import pytest

from router.schemas import ChatMessage
from router.tools import Answer, Call, ToolChoice, json_string_prefix
from workers.chat import TOOLS_INTRO, calls_text, with_tools_described
from workers.engine import SpecEngine
from workers.structured import format_error

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
AUTO = ToolChoice({"get_weather": WEATHER}, auto=True)


@pytest.mark.parametrize(("body", "text"), [
    ("Hello wor", "Hello wor"),
    ('done"}', "done"),  # the closing quote ends it
    ("a\\", "a"),  # an escape cut short waits
    ("a\\nb", "a\nb"),
    ("caf\\u00e", "caf"),
    ("caf\\u00e9!", "café!"),
    ("smile \\ud83d", "smile "),  # a high surrogate waits for its pair
    ("smile \\ud83d\\ude00", "smile \U0001F600"),
    ('say \\"hi\\"', 'say "hi"'),
])
def test_json_string_prefix_decodes_what_is_whole(body: str, text: str) -> None:
    assert json_string_prefix(body) == text


def test_auto_holds_the_output_to_calls_or_an_answer() -> None:
    assert format_error(AUTO.output_format) is None
    branches = json.loads(AUTO.output_format.spec)["anyOf"]
    assert [b["required"] for b in branches] == [["tool_calls"], ["response"]]
    calls = '{"tool_calls": [{"name": "get_weather", "parameters": {"city": "Paris"}}]}'
    assert AUTO.answer(calls, "stop") == Answer([Call("get_weather", '{"city": "Paris"}')], None, "tool_calls")
    assert AUTO.answer('{"response": "It is sunny."}', "stop") == Answer(None, "It is sunny.", "stop")
    # max_tokens cut it short: an answer keeps what decodes, calls come back as the text
    assert AUTO.answer('{"response": "It is su', "length") == Answer(None, "It is su", "length")
    assert AUTO.answer(calls[:30], "length") == Answer(None, calls[:30], "length")


def test_only_an_answer_streams_under_auto() -> None:
    assert AUTO.streamed_content('{"resp') == ""  # may still become an answer
    assert AUTO.streamed_content('{"response": "It is \\u00') == "It is "
    assert AUTO.streamed_content('{"tool_calls": [') is None
    assert ToolChoice({"get_weather": WEATHER}).streamed_content('[{"name') is None  # "required": calls only


def test_tools_are_described_in_the_system_message() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    user = {"role": "user", "content": "Weather in Paris?"}
    [system, again] = with_tools_described([user], tools)
    assert system["role"] == "system" and again == user
    assert system["content"].splitlines() == [TOOLS_INTRO, json.dumps(tools[0]["function"])]
    [merged, _] = with_tools_described([{"role": "system", "content": "Be brief."}, user], tools)
    assert merged["content"].startswith("Be brief.\n\n" + TOOLS_INTRO)


def test_earlier_calls_are_written_as_the_model_writes_calls() -> None:
    """An agent's loop sends the assistant's calls back with the tool's result: where the template
    does not render tools, the calls become the assistant's text in the form "auto" writes, which
    parses back into the same calls."""
    sent = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
    message = sent.as_template_message()
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    result = ChatMessage(role="tool", content="21 C", tool_call_id="call_1").as_template_message()
    assert result == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    [_, assistant, tool] = with_tools_described([message, result], [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}])
    assert assistant == {"role": "assistant", "content": calls_text(message["tool_calls"])} and tool == result
    assert AUTO.answer(assistant["content"], "stop").calls == [Call("get_weather", '{"city": "Paris"}')]


def test_a_template_without_tools_gets_them_in_its_system_message(tiny_engine: SpecEngine) -> None:
    """SmolLM2's template ignores `tools`: the prompt lists them all the same."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain, with_tools = tiny_engine.encode(messages), tiny_engine.encode(messages, tools=tools)
    assert with_tools != plain and with_tools == tiny_engine.encode(with_tools_described(messages, tools))
    assert "get_weather" in tiny_engine.tokenizer.decode(with_tools)
