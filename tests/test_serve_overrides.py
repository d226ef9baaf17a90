"""`specroute serve` deploys a Serve config as `serve run` / `serve deploy` do. Its own module: one
Ray instance per process, and tests/test_serve.py keeps one up for its module. One application
serves every test here, configured as a deployment would combine them: a `deployments:` override
with the policy as user_config, priority scheduling over one KV slot, and a target with its own
chat template, Hermes' tool-call syntax and sampling defaults (its generation_config.json's, one
overridden in the config). The KV slot, the template, the parser and the context length are set by
`specroute serve`'s flags, over the config's values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
import requests
import yaml
from helpers import HERMES_TEMPLATE, serve_tiny_app
from prometheus_client.parser import text_string_to_metric_families

from policies.schema import DEFAULT_POLICY_PATH
from router.cli import build_parser, serve_overrides
from workers.config import EngineConfig, GenerationDefaults

MODEL = "tiny-test-model"
MAX_MODEL_LEN = 768  # `specroute serve --max-model-len`'s (the config says 1024)
# the target's generation_config.json recommends (top_k 1: its likeliest token, whatever the temperature)
RECOMMENDED_SAMPLING = {"temperature": 0.5, "top_k": 1, "max_new_tokens": 7}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def url(tiny_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("serve")
    policy = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    policy["version"] = "from-user-config"
    overrides = [{"name": "TargetWorker", "user_config": {"policy": policy}, "max_ongoing_requests": 3}]
    (workdir / "hermes.jinja").write_text(HERMES_TEMPLATE)
    target = shutil.copytree(tiny_config.target.model, workdir / "target")
    generation = target / "generation_config.json"  # save_pretrained's: the token ids
    generation.write_text(json.dumps({**json.loads(generation.read_text()), **RECOMMENDED_SAMPLING}))
    config = tiny_config.model_copy(update={
        "scheduler": tiny_config.scheduler.model_copy(update={"policy": "priority"}),
        "target": tiny_config.target.model_copy(update={
            "model": str(target), "override_generation_config": GenerationDefaults(max_new_tokens=5)}),
    })
    flags = build_parser().parse_args(["serve", "--chat-template", str(workdir / "hermes.jinja"), "--tool-call-parser",
                                       "hermes", "--max-num-seqs", "1", "--max-model-len", str(MAX_MODEL_LEN)])
    with serve_tiny_app(config, workdir, MODEL, deployments=overrides, overrides=serve_overrides(flags)) as base_url:
        yield base_url


def test_serve_config_overrides_and_user_config_apply(url: str) -> None:
    """`specroute serve` deploys like `serve deploy`: a `deployments:` entry (here the policy as
    user_config, next to an option override) reaches the replicas, and so do the args its flags set
    (the chat template, the tool-call parser and one KV slot are theirs too, tested below)."""
    from ray import serve

    r = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["speculation"]["policy_version"] == "from-user-config"
    models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [m["max_model_len"] for m in models] == [MAX_MODEL_LEN]
    worker = serve.status().applications["specroute"].deployments["TargetWorker"]
    assert worker.status == "HEALTHY"


def test_priority_policy_preempts_over_http(url: str) -> None:
    """`scheduler.policy: priority` over HTTP: with one KV slot, a request of priority 0 sent while
    one of priority 1 streams a long answer preempts it and is answered; the preempted request
    resumes and completes, and /metrics and /v1/stats count one preemption."""
    low = {"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "priority": 1, "stream": True,
           "stream_options": {"include_usage": True}, "speculation": {"drafter": "none"}}
    with requests.post(f"{url}/v1/completions", json=low, stream=True, timeout=120) as stream:
        events = (line[len(b"data: "):] for line in stream.iter_lines() if line.startswith(b"data: "))
        first = json.loads(next(events))  # the low-priority request holds the slot
        high = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                             timeout=60)
        rest = list(events)
    assert first["choices"][0]["text"] is not None and rest[-1] == b"[DONE]"
    assert high.status_code == 200, high.text
    assert high.json()["usage"]["completion_tokens"] == 4
    assert json.loads(rest[-2])["usage"]["completion_tokens"] == 600
    metrics = {s.name: s.value for f in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text)
               for s in f.samples}
    assert metrics["specroute_num_preemptions_total"] == 1
    assert requests.get(f"{url}/v1/stats", timeout=30).json()["batching"]["num_preemptions"] == 1


def test_hermes_tool_calls_over_http(url: str) -> None:
    """A target with its own chat template (a file) and Hermes' tool-call syntax: "required" calls
    come back parsed from <tool_call> blocks on chat and on /v1/responses, streamed alike; "auto"
    answers however the model writes, content or calls, streamed alike; the conversation goes on."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    common = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
              "max_tokens": 120, "temperature": 0, "parallel_tool_calls": False}
    required = client.chat.completions.create(tool_choice="required", **common).choices[0]
    [call] = required.message.tool_calls
    assert required.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"} and required.message.content is None
    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **common))
    [streamed] = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls
                  for t in c.choices[0].delta.tool_calls]
    assert streamed.function.arguments == call.function.arguments
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tool_choice="required",
                                       tools=[{"type": "function", **WEATHER["function"]}], max_output_tokens=120,
                                       temperature=0, parallel_tool_calls=False)
    assert [(i.type, i.arguments) for i in response.output] == [("function_call", call.function.arguments)]
    auto = client.chat.completions.create(**common).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **common))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (auto.message.content or "")
    assert auto.message.content or auto.message.tool_calls
    turn = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER], messages=[
        *common["messages"], {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
    assert turn.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_omitted_sampling_fields_take_the_models_generation_config(url: str) -> None:
    """As vLLM serves a model whose creator recommends sampling: a request that leaves a field out
    gets the model's generation_config.json value (top_k 1 here, so it answers greedily), under
    the config's override (max_tokens 5 over the file's 7); what a request sets stays. The
    Responses API reports the temperature it sampled at."""
    def chat(**fields: object) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "ignore_eos": True}
        r = requests.post(f"{url}/v1/chat/completions", json={**body, **fields}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    defaulted = chat()
    assert defaulted["usage"]["completion_tokens"] == 5
    greedy = chat(temperature=0, max_tokens=5)
    assert defaulted["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    sampled = chat(top_k=0, seed=0, max_tokens=5)
    assert sampled["choices"][0]["message"]["content"] != greedy["choices"][0]["message"]["content"]
    assert chat(max_tokens=3)["usage"]["completion_tokens"] == 3
    response = requests.post(f"{url}/v1/responses", json={"model": MODEL, "input": "Tell me a story",
                                                          "ignore_eos": True}, timeout=60).json()
    assert (response["temperature"], response["usage"]["output_tokens"]) == (0.5, 5)
