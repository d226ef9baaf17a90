"""Tool calls for any model (router/tools.py, workers/chat.py): "auto" as calls or an answer under
one grammar, the answer's text streaming as it is written, and tool definitions in the system
message where the chat template does not render them; Hermes' <tool_call> blocks and Llama 3's bare
JSON calls for targets with those parsers, and a chat template from the config."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import HERMES_TEMPLATE

from router.schemas import ChatMessage
from router.tools import NO_PARAMETERS, Answer, Call, ToolChoice, json_string_prefix
from workers.chat import TOOLS_INTRO, calls_text, with_tools_described
from workers.config import EngineConfig
from workers.engine import SpecEngine
from workers.sampling import SamplingParams
from workers.structured import format_error
from workers.target import ModelLoadError, read_chat_template

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


# -- Hermes' <tool_call> blocks (target.tool_call_parser: hermes) -------------------------------
HERMES = ToolChoice({"get_weather": WEATHER, "now": NO_PARAMETERS}, parser="hermes")
HERMES_AUTO = ToolChoice({"get_weather": WEATHER, "now": NO_PARAMETERS}, auto=True, parser="hermes")


def _block(name: str, arguments: dict) -> str:
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": arguments}) + '\n</tool_call>'


def test_hermes_blocks_become_calls_and_the_text_before_them_content() -> None:
    two = _block("get_weather", {"city": "Paris"}) + "\n" + _block("now", {})
    assert HERMES_AUTO.answer("Let me check.\n" + two, "stop") == Answer(
        [Call("get_weather", '{"city": "Paris"}'), Call("now", "{}")], "Let me check.\n", "tool_calls")
    assert HERMES_AUTO.answer(two, "stop").content is None
    assert replace(HERMES_AUTO, parallel=False).answer(two, "stop").calls == [Call("get_weather", '{"city": "Paris"}')]
    assert HERMES_AUTO.answer("It is sunny.", "stop") == Answer(None, "It is sunny.", "stop")
    for broken in ('<tool_call>\n{"name": "get_weather", "argu', _block("fly", {}), "<tool_call>\nnot json\n</tool_call>"):
        assert HERMES_AUTO.answer("So: " + broken, "length") == Answer(None, "So: " + broken, "length")
    named = ToolChoice({"get_weather": WEATHER}, name="get_weather", parser="hermes")
    assert named.answer(_block("get_weather", {"city": "Oslo"}), "stop").finish_reason == "stop"
    assert HERMES.answer(_block("now", {}), "stop").finish_reason == "tool_calls"


def test_hermes_auto_streams_the_text_before_a_block() -> None:
    assert HERMES_AUTO.streamed_content("It is sun") == "It is sun"
    assert HERMES_AUTO.streamed_content("Checking <tool_") == "Checking "  # may begin a block: held back
    assert HERMES_AUTO.streamed_content("Checking <tool_call>\n{") == "Checking "
    assert HERMES_AUTO.streamed_content("a < b") == "a < b"
    assert HERMES.streamed_content("<tool_call>") is None  # "required": calls only, whole at the end


def test_hermes_formats_hold_the_output_to_blocks_of_the_tools_calls() -> None:
    assert HERMES_AUTO.output_format is None  # "auto": the model writes freely, as vLLM's hermes parser lets it
    grammars = [HERMES.output_format, replace(HERMES, parallel=False).output_format,
                ToolChoice({"get_weather": WEATHER}, name="get_weather", parser="hermes").output_format]
    assert all(g is not None and g.kind == "grammar" and format_error(g) is None for g in grammars)
    assert '("\\n" call)*' in grammars[0].spec and "call)*" not in grammars[1].spec + grammars[2].spec


@pytest.mark.parametrize("drafter", ["none", "self", "ngram"])
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_calls_decoded_under_a_parsers_grammar_parse_and_stay_lossless(tiny_engine: SpecEngine, drafter: str,
                                                                       parser: str) -> None:
    short = {**WEATHER, "properties": {"city": {"type": "string", "maxLength": 8}}}  # the random model rambles
    choice = ToolChoice({"get_weather": short}, parallel=False, parser=parser)  # type: ignore[arg-type]
    prompt = tiny_engine.encode([{"role": "user", "content": "Weather in Paris?"}])
    params = SamplingParams(max_tokens=120, output_format=choice.output_format)
    plain = tiny_engine.generate(prompt, params)
    out = tiny_engine.generate(prompt, params, drafter, 3)
    assert out.token_ids == plain.token_ids and out.finish_reason == "stop"
    answer = choice.answer(out.text, out.finish_reason)
    assert answer.calls is not None and len(answer.calls) == 1 and answer.calls[0].name == "get_weather"
    assert set(json.loads(answer.calls[0].arguments)) == {"city"}
    assert out.text.startswith({"hermes": "<tool_call>\n{", "llama3_json": '{"name": "get_weather", "parameters": '}[
        parser])


def test_hermes_calls_are_written_back_as_blocks_and_described_where_the_template_ignores_tools() -> None:
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
    }).as_template_message()
    assert calls_text(message["tool_calls"], "hermes") == _block("get_weather", {"city": "Oslo"})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    [system, assistant] = with_tools_described([message], tools, "hermes")
    assert "<tool_call>" in system["content"] and assistant["content"] == _block("get_weather", {"city": "Oslo"})


# -- Llama 3's bare JSON calls (target.tool_call_parser: llama3_json) ------------------------------
LLAMA = ToolChoice({"get_weather": WEATHER, "now": NO_PARAMETERS}, parser="llama3_json")
LLAMA_AUTO = replace(LLAMA, auto=True)


def _json_call(name: str, parameters: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: parameters})


def test_llama3_json_calls_are_the_whole_output_or_none_of_it() -> None:
    two = _json_call("get_weather", {"city": "Paris"}) + "; " + _json_call("now", {})
    calls = [Call("get_weather", '{"city": "Paris"}'), Call("now", "{}")]
    assert LLAMA_AUTO.answer(two, "stop") == Answer(calls, None, "tool_calls")
    assert LLAMA_AUTO.answer(" " + two.replace("; ", " ;\n") + "\n", "stop").calls == calls  # blanks around
    assert replace(LLAMA_AUTO, parallel=False).answer(two, "stop").calls == calls[:1]
    assert LLAMA_AUTO.answer(_json_call("now", {}, "arguments"), "stop").calls == [Call("now", "{}")]  # as vLLM reads
    for text in ("It is sunny.", "Sure: " + two, two + " done", '{"name": "get_weather", "param',
                 _json_call("fly", {}), '{"not": "a call"}'):
        assert LLAMA_AUTO.answer(text, "length") == Answer(None, text, "length")
    named = ToolChoice({"get_weather": WEATHER}, name="get_weather", parser="llama3_json")
    assert named.answer(_json_call("get_weather", {"city": "Oslo"}), "stop").finish_reason == "stop"


def test_llama3_json_auto_streams_text_and_holds_what_may_be_calls() -> None:
    assert LLAMA_AUTO.streamed_content("It is {sun") == "It is {sun"
    assert LLAMA_AUTO.streamed_content(" \n") == ""  # may still open a call
    assert LLAMA_AUTO.streamed_content(' {"name": "now"') == ""
    assert LLAMA.streamed_content("{") is None  # "required": calls only, whole at the end


def test_llama3_json_formats_and_calls_written_back() -> None:
    assert LLAMA_AUTO.output_format is None
    grammars = [LLAMA.output_format, replace(LLAMA, parallel=False).output_format]
    assert all(g is not None and format_error(g) is None for g in grammars)
    assert '("; " call)*' in grammars[0].spec and "call)*" not in grammars[1].spec
    assert '"parameters"' in grammars[0].spec and "<tool_call>" not in grammars[0].spec
    message = {"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}, {"function": {"name": "now", "arguments": {}}}]}
    assert calls_text(message["tool_calls"], "llama3_json") == (
        _json_call("get_weather", {"city": "Oslo"}) + "; " + _json_call("now", {}))
    [system, _] = with_tools_described([message], [{"type": "function", "function": {"name": "now"}}], "llama3_json")
    assert '"parameters"' in system["content"] and "<tool_call>" not in system["content"]


def test_a_configured_chat_template_renders_the_tools(tiny_config: EngineConfig, tmp_path: Path) -> None:
    """`target.chat_template` (a file, or the text) replaces the tokenizer's: this one renders
    tools and calls itself, so nothing is added to the system message."""
    (tmp_path / "hermes.jinja").write_text(HERMES_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18 C"}]
    for template in (str(tmp_path / "hermes.jinja"), HERMES_TEMPLATE):
        target = tiny_config.target.model_copy(update={"chat_template": template, "tool_call_parser": "hermes"})
        engine = SpecEngine.from_config(tiny_config.model_copy(update={"target": target, "drafters": []}))
        text = engine.tokenizer.decode(engine.encode(messages, tools=tools))
        assert '<tools>\n{"type": "function"' in text and TOOLS_INTRO not in text
        assert _block("get_weather", {"city": "Paris"}) in text and "<tool_response>\n18 C" in text
    with pytest.raises(ModelLoadError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
