"""Reasoning models (target.reasoning_parser): the thinking answered apart from the answer, split
alike however the output streams; where the thinking starts read from the rendered prompt;
response formats holding the answer after it, losslessly under speculation; and over HTTP, chat
and /v1/responses with a template that opens the thinking unless `chat_template_kwargs` turn it off
and reads the reasoning effort."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import requests
from helpers import THINKING_TEMPLATE, serve_tiny_app

from workers.config import EngineConfig
from workers.reasoning import Parts, ReasoningSplit, reasoning_start, reasoning_tokens, split_output
from workers.sampling import SamplingParams
from workers.structured import OutputFormat

MODEL = "tiny-thinker"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


# -- the split ------------------------------------------------------------------------------------
def split_whole(start: str, text: str, cuts: list[int]) -> tuple[str, str]:
    """`text` fed in pieces cut at `cuts`: the reasoning and the answer."""
    split = ReasoningSplit(start)  # type: ignore[arg-type]
    bounds = [0, *cuts, len(text)]
    parts = [split.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [split.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


@pytest.mark.parametrize(("start", "text", "reasoning", "content"), [
    ("open", "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n", "It is 4."),
    ("closed", "<think>\nhm</think>Hi <think>", "hm", "Hi <think>"),
    ("closed", "  \n<think>a</think></think>b", "a", "</think>b"),  # the first closing tag ends it
    ("closed", "Hello <think> there", "", "Hello <think> there"),
    ("closed", "<thi", "", "<thi"),  # an opening tag cut short by the end: text
    ("open", "never closed </thi", "never closed </thi", ""),  # max_tokens: reasoning only
    ("open", "</think>", "", ""),
    ("closed", "", "", ""),
])
def test_the_split_is_the_same_however_the_text_is_cut(start: str, text: str, reasoning: str, content: str) -> None:
    assert split_whole(start, text, []) == (reasoning, content)
    assert split_output(text, start) == Parts(reasoning, content)  # a whole output, as the CLI splits it
    for cut in range(len(text) + 1):
        assert split_whole(start, text, [cut]) == (reasoning, content), cut
    assert split_whole(start, text, list(range(1, len(text)))) == (reasoning, content)  # a character a delta


def test_the_split_holds_back_only_what_may_become_a_tag() -> None:
    split = ReasoningSplit("open")
    assert split.feed("I see </th") == Parts(reasoning="I see ")
    assert split.feed("at") == Parts(reasoning="</that")  # not the tag after all
    assert split.feed("</think>\n") == Parts()  # blanks may lead the answer: dropped, not held
    assert split.feed("Yes") == Parts(content="Yes")
    assert split.finish() == Parts()


@pytest.mark.parametrize(("tail", "start"), [
    ("<|im_start|>assistant\n<think>\n", "open"),  # DeepSeek-R1's template
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),  # Qwen3's enable_thinking false
    ("<|im_start|>assistant\n", "closed"),  # Qwen3's thinking: the model opens it
    ("<|im_start|>assistant\n<think>\nSo</think>The answer", "closed"),  # a continued message, past thinking
])
def test_where_the_output_starts_is_read_from_the_prompt(tail: str, start: str) -> None:
    assert reasoning_start(tail) == start


def test_the_thinking_counts_the_tokens_that_hold_it() -> None:
    pieces = ["<think>", "\n", "Two", " and", " two", ".</", "think", ">\n\n", "4", "."]

    def decode(ids) -> str:
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    assert reasoning_tokens(ids, decode, "closed") == 8  # the closing tag ends inside token 7
    assert reasoning_tokens(ids[1:], decode, "open") == 7  # the prompt opened it
    assert reasoning_tokens(ids[:6], decode, "closed") == 6  # never closed: all of it
    assert reasoning_tokens(ids[8:], decode, "closed") == 0  # no thinking
    assert reasoning_tokens([], decode, "open") == 0


# -- formats after the thinking ---------------------------------------------------------------
def accepts(engine, fmt: OutputFormat, text: str) -> bool:
    """Whether `text` (tokenized as the model would write it) is a whole output of `fmt`."""
    guide = engine.grammars.guide(fmt, set(engine.target.model.info.eos_token_ids))
    ids = engine.encode_text(text)
    if guide.valid_prefix(ids) < len(ids):
        return False
    for t in ids:
        guide.advance(t)
    return guide.matcher.is_accepting()


@pytest.mark.parametrize("fmt", [OutputFormat.json_schema(SCHEMA), OutputFormat("regex", "[0-9]+"),
                                 OutputFormat.choice(["yes", "no"]),
                                 OutputFormat("grammar", 'start: "n=" num\nnum: %json {"type": "integer"}')],
                         ids=["schema", "regex", "choice", "grammar"])
def test_a_format_holds_the_answer_after_the_thinking(self_drafting_engine, fmt: OutputFormat) -> None:
    answer = {"json": '{"n": 7}', "regex": "42", "choice": "no", "grammar": "n=3"}[fmt.kind]
    opened, closed = (replace(fmt, reasoning=s) for s in ("open", "closed"))
    assert accepts(self_drafting_engine, fmt, answer)
    assert accepts(self_drafting_engine, opened, f"Any {{text}} <b>\n</think>\n\n{answer}")
    assert not accepts(self_drafting_engine, opened, answer)  # still thinking: not a whole output
    assert not accepts(self_drafting_engine, opened, f"x</think>{answer}</think>{answer}")  # the first tag ends it
    assert not accepts(self_drafting_engine, opened, "x</think>nonsense")
    assert accepts(self_drafting_engine, closed, answer)
    assert accepts(self_drafting_engine, closed, f"<think>\nhm</think>\n{answer}")
    assert not accepts(self_drafting_engine, closed, f"hm</think>{answer}")  # thinking opens with its tag


@pytest.mark.parametrize("drafter", ["ngram", "self", "self_tree"])
@pytest.mark.parametrize("start", ["open", "closed"])
def test_guided_output_after_thinking_is_guided_plain_output(self_drafting_engine, drafter: str, start: str) -> None:
    """Free thinking then a schema (the tiny model never closes its thinking: all of it free) or
    the schema at once (it opens none): either way the drafters change no token."""
    engine = self_drafting_engine
    fmt = replace(OutputFormat.json_schema(SCHEMA), reasoning=start)
    params = SamplingParams(max_tokens=24, output_format=fmt)
    prompt = engine.encode("Count to three, then answer as JSON.")
    plain = engine.generate(prompt, params)
    assert engine.generate(prompt, params, drafter, 4).token_ids == plain.token_ids
    if start == "closed" and not plain.text.startswith("<think>"):
        jsonschema.validate(json.loads(plain.text), SCHEMA)


# -- /v1/responses' events -----------------------------------------------------------------------
def test_a_streamed_response_puts_the_reasoning_item_first() -> None:
    """The reasoning item opens with the first thinking, closes when the answer starts, and the
    message follows it at output index 1; the completed response holds both."""
    from router.responses import ResponseEvents, ResponseObject, ResponsesRequest
    from workers.result import GenerationResult

    response = ResponseObject.started(ResponsesRequest(input="What is 2 + 2?"), "resp_1", MODEL, store=False)
    events = ResponseEvents(response, None)
    stream = [*events.start(), *events.reasoning("Two and"), *events.reasoning(" two."), *events.reasoning(""),
              *events.text("It is"), *events.text(" 4.")]
    result = GenerationResult(prompt_token_ids=[1, 2], token_ids=[3] * 9, text="", finish_reason="stop", num_steps=9,
                              num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[],
                              drafted_per_position=[], drafters=[], prefill_s=0.0, wall_s=0.1, ttft_s=0.01,
                              num_reasoning_tokens=5)
    stream += events.finish("stop", result, None)  # type: ignore[arg-type]
    payloads = [json.loads(e.split("data: ", 1)[1]) for e in stream]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [(p["type"].removeprefix("response."), p.get("output_index")) for p in payloads] == [
        ("created", None), ("in_progress", None),
        ("output_item.added", 0), ("reasoning_text.delta", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.done", 0), ("output_item.done", 0),
        ("output_item.added", 1), ("content_part.added", 1), ("output_text.delta", 1), ("output_text.delta", 1),
        ("output_text.done", 1), ("content_part.done", 1), ("output_item.done", 1), ("completed", None)]
    assert payloads[5]["text"] == "Two and two." and payloads[11]["text"] == "It is 4."
    done = payloads[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == [{"type": "reasoning_text", "text": "Two and two."}]
    assert done["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}


# -- over HTTP ------------------------------------------------------------------------------------
def test_reasoning_over_http(tiny_config: EngineConfig, tmp_path: Path) -> None:
    """The thinking the prompt opened comes back as `reasoning` (the tiny model never closes it, so
    there is no content), streamed alike, on chat and /v1/responses; `enable_thinking: false`
    closes it in the prompt, so the whole output is the answer; a format holds that answer."""
    import openai

    (tmp_path / "thinking.jinja").write_text(THINKING_TEMPLATE)
    target = tiny_config.target.model_copy(update={"chat_template": str(tmp_path / "thinking.jinja"),
                                                   "reasoning_parser": "deepseek_r1"})
    with serve_tiny_app(tiny_config.model_copy(update={"target": target}), tmp_path, MODEL) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        common = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 16,
                  "temperature": 0}
        completion = client.chat.completions.create(**common)
        thought = completion.choices[0]
        reasoning = thought.message.model_extra["reasoning"]
        assert reasoning and thought.message.content is None and thought.finish_reason == "length"
        assert completion.usage.completion_tokens_details.reasoning_tokens == 16  # all of it thinking
        chunks = list(client.chat.completions.create(stream=True, **common))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
        assert not any(d.content for d in deltas)

        off = {"chat_template_kwargs": {"enable_thinking": False}}
        answered = client.chat.completions.create(extra_body=off, **common)
        answer = answered.choices[0]
        assert "reasoning" not in answer.message.model_extra and answer.message.content
        assert answered.usage.completion_tokens_details is None
        assert answer.message.content != reasoning  # another prompt: another output
        hidden = client.chat.completions.create(extra_body={"include_reasoning": False}, **common).choices[0]
        assert "reasoning" not in hidden.message.model_extra and hidden.message.content is None

        schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
        guided = client.chat.completions.create(extra_body=off, response_format=schema, **{
            **common, "max_tokens": 40}).choices[0]
        assert guided.finish_reason == "stop"
        jsonschema.validate(json.loads(guided.message.content), SCHEMA)

        effort = client.chat.completions.create(reasoning_effort="high", **common)
        assert effort.usage.prompt_tokens > completion.usage.prompt_tokens  # the template's Reasoning: line

        response = client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=16, temperature=0)
        high = client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=1,
                                       reasoning={"effort": "high"})
        assert high.usage.input_tokens == effort.usage.prompt_tokens > response.usage.input_tokens
        [item] = response.output
        assert item.type == "reasoning" and item.content[0].text == reasoning
        assert response.usage.output_tokens_details.reasoning_tokens == 16
        events = list(client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=16,
                                              temperature=0, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
        assert [e.type for e in events if e.type.startswith("response.output_item")] == [
            "response.output_item.added", "response.output_item.done"]
        assert events[-1].response.output[0].content[0].text == reasoning

        # an assistant's earlier reasoning may be sent back; template variables are the template's
        turn = {**common, "messages": [*common["messages"], {"role": "assistant", "content": "4",
                                                             "reasoning": reasoning},
                                       {"role": "user", "content": "And 3 + 3?"}]}
        assert requests.post(f"{url}/v1/chat/completions", json=turn, timeout=60).status_code == 200
        tokens = [requests.post(f"{url}/tokenize", json={"messages": common["messages"], **extra},
                                timeout=60).json()["count"] for extra in ({}, off)]
        assert tokens[1] > tokens[0]  # the empty thinking block
        bad = requests.post(f"{url}/v1/chat/completions", timeout=60,
                            json={**common, "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
