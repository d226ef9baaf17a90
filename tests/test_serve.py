"""The real Serve application over HTTP: local Ray, Serve on 127.0.0.1, the tiny random target.

One app per module (starting Ray and Serve takes most of this module's time). The `openai` client
is used unchanged where it can be; raw HTTP where the test is about the wire (SSE, error shapes).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from helpers import num_finished, serve_tiny_app, wait_for

from workers.config import EngineConfig, PredictionDrafterConfig

openai = pytest.importorskip("openai")

MODEL = "tiny-test-model"
ALIAS = "tiny-alias"  # a second served name of the same model
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def base_url(tiny_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tiny_config.model_copy(update={"drafters": [*tiny_config.drafters, PredictionDrafterConfig()],
                                            "log_stats_interval_s": 1.0, "log_requests": True})
    with serve_tiny_app(config, tmp_path_factory.mktemp("serve"), MODEL, served_model_name=[MODEL, ALIAS]) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str):  # -> openai.OpenAI
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(base_url: str, **body) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count: one two three"}], **body}
    return requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)


def _sse(response: requests.Response) -> Iterator[dict | str]:
    """Parsed `data:` events of an SSE response; "[DONE]" as the string."""
    for line in response.iter_lines():
        if line:
            assert line.startswith(b"data: "), line
            data = line[len(b"data: "):]
            yield "[DONE]" if data == b"[DONE]" else json.loads(data)


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["serve.cpu.yaml", "serve.gpu.yaml"])
def test_deploy_configs_validate(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    from router.app import AppArgs
    from workers.config import load_engine_config

    path = DEPLOY / name
    data = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(data)
    engine = load_engine_config(path)
    app = data["applications"][0]
    assert app["import_path"] == "router.app:build_app"
    args = AppArgs.model_validate(app["args"])
    assert args.engine == engine and engine.drafters
    assert args.num_gpus == (1 if "gpu" in name else 0)


def test_sampling_defaults_fill_only_what_a_request_left_out() -> None:
    """Every endpoint's request takes the model's defaults for the sampling fields it did not send,
    max_tokens under the endpoint's own name for it, and keeps what it sent."""
    from router.messages import MessagesRequest
    from router.responses import ResponsesRequest
    from router.schemas import ChatCompletionRequest, CompletionRequest, with_sampling_defaults

    defaults = {"temperature": 0.6, "top_k": 20, "min_p": 0.05, "max_tokens": 7}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    filled = with_sampling_defaults(ChatCompletionRequest.model_validate({**chat, "temperature": 0}), defaults)
    assert (filled.temperature, filled.top_k, filled.min_p, filled.num_max_tokens) == (0, 20, 0.05, 7)
    capped = ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 3})
    assert with_sampling_defaults(capped, defaults).num_max_tokens == 3
    completion = with_sampling_defaults(CompletionRequest.model_validate({"prompt": "hi", "top_k": 0}), defaults)
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (0.6, 0, 7)
    response = with_sampling_defaults(ResponsesRequest.model_validate({"input": "hi"}), defaults)
    assert (response.temperature, response.top_k, response.max_output_tokens) == (0.6, 20, 7)
    message = with_sampling_defaults(MessagesRequest.model_validate({**chat, "max_tokens": 2}), defaults)
    assert (message.temperature, message.top_k, message.max_tokens) == (0.6, 20, 2)
    assert with_sampling_defaults(capped, {}) is capped


# -- the HTTP contract ---------------------------------------------------------------------------
def test_healthz_and_models(base_url: str, client) -> None:
    assert requests.get(f"{base_url}/healthz", timeout=10).status_code == 200
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200  # vLLM's path
    assert requests.get(f"{base_url}/version", timeout=10).json()["version"] == importlib.metadata.version("specroute")
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]  # vLLM's list of served names
    assert client.models.retrieve(MODEL).id == MODEL and client.models.retrieve(ALIAS).id == ALIAS
    r = requests.get(f"{base_url}/v1/models/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert f"'{MODEL}', '{ALIAS}'" in r.json()["error"]["message"]
    # a request may name either; the answer carries the first name, as vLLM's do
    answer = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2, temperature=0)
    assert answer.model == MODEL


def test_chat_completion(client) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=16, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length")
    assert isinstance(out.choices[0].message.content, str)
    assert 0 < out.usage.completion_tokens <= 16
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    spec = out.model_extra["speculation"]
    # auto: the shipped policy routes "Hello" (chat) to prompt lookup or plain decoding
    assert spec["drafter"] in ("ngram", "none") and spec["reason"] in ("best", "explore", "fallback")
    assert spec["domain"] == "chat" and spec["policy_version"] == "default-7"
    assert sum(steps for _, _, steps in spec["schedule"]) == spec["num_steps"]


def test_completion_max_completion_tokens_and_raw_prompt(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.usage.completion_tokens <= 8
    # the raw prompt is not wrapped in the chat template: 4-ish tokens, not 30
    assert out.usage.prompt_tokens < 10
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=5, max_tokens=50, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_equals_non_stream(client, kind: str) -> None:
    common = {"model": MODEL, "max_tokens": 40, "temperature": 0}
    if kind == "chat":
        messages = [{"role": "user", "content": "Tell a story"}]
        full = client.chat.completions.create(messages=messages, **common)
        stream = client.chat.completions.create(
            messages=messages, stream=True,
            stream_options={"include_usage": True}, **common)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = full.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        full = client.completions.create(prompt="Tell a story", **common)
        chunks = list(client.completions.create(prompt="Tell a story", stream=True,
                                                stream_options={"include_usage": True}, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert text == expected
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    # the routing decision of the second request reads statistics the first one wrote: compare
    # what does not depend on it
    stable = ("domain", "policy_version")
    streamed, whole = finals[0].model_extra["speculation"], full.model_extra["speculation"]
    assert {k: streamed[k] for k in stable} == {k: whole[k] for k in stable}
    assert sum(steps for _, _, steps in streamed["schedule"]) == streamed["num_steps"]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage  # include_usage: last chunk


def test_chat_logprobs_streamed_and_not(client) -> None:
    """The openai client's own types parse them; a stream's logprobs join into the whole response's."""
    # a fixed drafter and k: the float32 tiny target computes a row alike only in the same call shape
    common = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 24,
              "temperature": 0, "logprobs": True, "top_logprobs": 3,
              "extra_body": {"ignore_eos": True, "speculation": {"drafter": "self", "draft_len": 3}}}
    full = client.chat.completions.create(**common)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 24
    assert b"".join(bytes(t.bytes) for t in content).decode() == full.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.token == t.top_logprobs[0].token and t.logprob == t.top_logprobs[0].logprob  # greedy
    chunks = list(client.chat.completions.create(stream=True, **common))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == content
    plain = client.chat.completions.create(**{**common, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    as_ids = client.chat.completions.create(**{**common, "extra_body": {
        **common["extra_body"], "return_tokens_as_token_ids": True}}).choices[0].logprobs.content
    assert [t.logprob for t in as_ids] == [t.logprob for t in content]
    assert all(re.fullmatch(r"token_id:\d+", t.token) and bytes(t.bytes).decode() == t.token for t in as_ids)
    assert all(re.fullmatch(r"token_id:\d+", x.token) for t in as_ids for x in t.top_logprobs)


def test_completion_logprobs(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 5,
            "logprobs": 2, "ignore_eos": True, "speculation": {"drafter": "self", "draft_len": 3}}
    out = requests.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(12)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the two likeliest and the sampled one
    with requests.post(f"{base_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = [e for e in _sse(r) if e != "[DONE]"]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [x for p in parts for x in p["text_offset"]] == lp["text_offset"]  # the seed draws the same text
    assert [x for p in parts for x in p["token_logprobs"]] == lp["token_logprobs"]
    ids = requests.post(f"{base_url}/v1/completions", json={**body, "return_tokens_as_token_ids": True},
                        timeout=60).json()["choices"][0]["logprobs"]
    assert ids["text_offset"] == lp["text_offset"] and ids["token_logprobs"] == lp["token_logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in ids["tokens"]]
    text = requests.post(f"{base_url}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert text == out["choices"][0]["text"] and all(ids["tokens"][i] in ids["top_logprobs"][i] for i in range(12))


def test_completion_prompts_as_token_ids_and_several_at_once(base_url: str, client, tiny_llama_dir: Path) -> None:
    """A prompt's token ids give the text's output; several prompts get `n` choices each, indexed
    prompt by prompt, each prompt counted once in usage; streamed alike."""
    from transformers import AutoTokenizer

    texts = ["Once upon a time", "The weather today is"]
    ids = [AutoTokenizer.from_pretrained(tiny_llama_dir).encode(t) for t in texts]
    common = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    singles = [client.completions.create(prompt=t, **common) for t in texts]
    assert client.completions.create(prompt=ids[0], **common).choices[0].text == singles[0].choices[0].text
    echoed = client.completions.create(prompt=ids[1], echo=True, **common)
    assert echoed.choices[0].text == texts[1] + singles[1].choices[0].text

    for prompts in (texts, ids):
        out = client.completions.create(prompt=prompts, n=2, **common)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [s.choices[0].text for s in singles for _ in range(2)]
        assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert out.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
        chunks = list(client.completions.create(prompt=prompts, n=2, stream=True,
                                                stream_options={"include_usage": True}, **common))
        streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                    for i in range(4)]
        assert streamed == [c.text for c in out.choices] and chunks[-1].usage == out.usage


def test_echo_scores_the_prompt(base_url: str, client) -> None:
    """`echo`: the prompt ahead of the completion, with `logprobs` each prompt token's (the first
    none), as lm-evaluation-harness's loglikelihood requests send them; streamed alike."""
    prompt = "The quick brown fox jumps over the lazy dog"
    common = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = requests.post(f"{base_url}/v1/completions", json=common, timeout=60).json()
    echoed = requests.post(f"{base_url}/v1/completions", json={**common, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None and echoed["usage"] == plain["usage"]

    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp, n = scored.choices[0].logprobs, scored.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert "".join(lp.tokens) == scored.choices[0].text and scored.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) in (1, 2) for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n + 1)]
    # max_tokens 0: the prompt scored, nothing generated (what older lm-evaluation-harness sends)
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    assert only.choices[0].text == prompt and only.choices[0].finish_reason == "length"
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (n, 0)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert only.choices[0].logprobs.tokens == lp.tokens[:n]
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=60, json={
            **common, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}) as r:
        events = [e for e in _sse(r) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == prompt
    assert [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["token_logprobs"]
            ] == lp.token_logprobs[:n]

    body = {**common, "max_tokens": 4, "logprobs": 2, "echo": True, "speculation": {"drafter": "self", "draft_len": 2}}
    whole = requests.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    with requests.post(f"{base_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = [e for e in _sse(r) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [x for p in parts for x in p["token_logprobs"]] == whole["choices"][0]["logprobs"]["token_logprobs"]
    assert [x for p in parts for x in p["text_offset"]] == whole["choices"][0]["logprobs"]["text_offset"]


def test_prompt_logprobs_as_vllm_returns_them(base_url: str) -> None:
    """vLLM's `prompt_logprobs`: per prompt token (the first none) a dict by token id of its
    logprob, rank and text and its position's likeliest; the numbers an echo scores; beside an
    echo's own count, each use its own; with max_tokens 0 the prompt alone; on chat, top level."""
    prompt = "The quick brown fox jumps over the lazy dog"
    common = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    url = f"{base_url}/v1/completions"
    assert requests.post(url, json=common, timeout=60).json()["choices"][0]["prompt_logprobs"] is None
    out = requests.post(url, json={**common, "prompt_logprobs": 2, "echo": True, "logprobs": 1}, timeout=60).json()
    choice, n = out["choices"][0], out["usage"]["prompt_tokens"]
    scored, echoed = choice["prompt_logprobs"], choice["logprobs"]
    assert len(scored) == n and scored[0] is None
    assert all(len(d) <= 2 for d in echoed["top_logprobs"][1:n])  # the echo's own count: 1 and the token
    for i, position in enumerate(scored[1:], 1):
        token = echoed["tokens"][i]
        chosen = next(e for e in position.values() if e["decoded_token"] == token)
        assert chosen["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-6)
        ranked = sorted(position.values(), key=lambda e: e["rank"])  # the two likeliest, then the token if not
        assert [e["rank"] for e in ranked[:2]] == [1, 2] and len(ranked) in (2, 3)
        assert len(ranked) == 2 or ranked[2] is chosen and chosen["rank"] > 2
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
    as_ids = requests.post(url, json={**common, "prompt_logprobs": 0, "return_tokens_as_token_ids": True},
                           timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert all([f"token_id:{key}" for key in d] == [e["decoded_token"] for e in d.values()] for d in as_ids[1:])
    only = requests.post(url, json={**common, "max_tokens": 0, "prompt_logprobs": 2}, timeout=60).json()
    assert only["choices"][0]["text"] == "" and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["prompt_logprobs"] == scored and only["choices"][0]["logprobs"] is None

    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "temperature": 0,
            "n": 2}
    answer = requests.post(f"{base_url}/v1/chat/completions", json={**chat, "prompt_logprobs": 0}, timeout=60).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]  # one prompt for both choices
    assert answer["prompt_logprobs"][0] is None and all(len(d) == 1 for d in answer["prompt_logprobs"][1:])
    assert requests.post(f"{base_url}/v1/chat/completions", json=chat, timeout=60).json()["prompt_logprobs"] is None


def test_logit_bias_and_penalties(base_url: str, tiny_llama_dir: Path) -> None:
    """A bias of 100 outweighs every logit and penalty: the biased token, every time, drafted or not."""
    from transformers import AutoTokenizer

    dog = AutoTokenizer.from_pretrained(tiny_llama_dir).encode(" dog")
    assert len(dog) == 1
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(dog[0]): 100}, "presence_penalty": 2, "frequency_penalty": 1.5,
            "repetition_penalty": 1.2}
    for drafter in ("none", "self", "ngram"):
        out = requests.post(f"{base_url}/v1/completions", timeout=60,
                            json={**body, "speculation": {"drafter": drafter}}).json()
        assert out["choices"][0]["text"] == " dog" * 6, out
    unbiased = {**body, "logit_bias": None, "max_tokens": 24}
    texts = [requests.post(f"{base_url}/v1/completions", timeout=60,
                           json={**unbiased, "speculation": {"drafter": drafter}}).json()["choices"][0]["text"]
             for drafter in ("none", "self")]
    assert texts[0] == texts[1]


def test_vllm_sampling_extensions(base_url: str, tiny_llama_dir: Path) -> None:
    """A bias of 100 makes " dog" every token unless something bans it; each setting then shows
    plainly, drafted or not, streamed or not."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    (dog,), (cat,) = tokenizer.encode(" dog"), tokenizer.encode(" cat")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(dog): 100}}

    def complete(**extra) -> dict:
        outs = [requests.post(f"{base_url}/v1/completions", timeout=60,
                              json={**body, **extra, "speculation": {"drafter": drafter}}).json()
                for drafter in ("none", "self")]
        assert outs[0]["choices"] == outs[1]["choices"], outs
        return outs[0]

    stopped = complete(stop_token_ids=[dog])
    assert stopped["choices"][0]["text"] == " dog" and stopped["usage"]["completion_tokens"] == 1
    assert stopped["choices"][0]["stop_reason"] == dog  # vLLM's: what ended the output
    waited = complete(stop_token_ids=[dog], min_tokens=3)  # no stop token before 3 tokens
    assert waited["choices"][0]["text"].endswith(" dog") and waited["usage"]["completion_tokens"] == 4
    assert " dog" not in waited["choices"][0]["text"][: -len(" dog")]
    assert waited["choices"][0]["finish_reason"] == "stop"
    assert complete(stop=[" dog"])["choices"][0]["text"] == ""
    assert complete(stop=[" cow", " dog"])["choices"][0]["stop_reason"] == " dog"
    assert complete(stop=[" dog"], include_stop_str_in_output=True)["choices"][0]["text"] == " dog"
    kept = complete(stop=[" dog"], include_stop_str_in_output=True, min_tokens=2)
    assert kept["choices"][0]["text"] == " dog" * 3  # the string must end past the first 2 tokens
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=60,
                       json={**body, "stop": [" dog"], "include_stop_str_in_output": True, "min_tokens": 2,
                             "stream": True}) as r:
        assert "".join(e["choices"][0]["text"] for e in _sse(r) if e != "[DONE]") == " dog" * 3
    assert "dog" not in complete(bad_words=["dog"])["choices"][0]["text"]
    assert complete(allowed_token_ids=[cat])["choices"][0]["text"] == " cat" * 6
    eos = tokenizer.eos_token_id
    special = {"logit_bias": {str(eos): 100}, "max_tokens": 2}
    assert complete(**special)["choices"][0]["text"] == ""
    assert complete(**special)["choices"][0]["stop_reason"] is None  # end of sequence
    assert complete(**special, skip_special_tokens=False)["choices"][0]["text"] == tokenizer.eos_token * 2
    long_prompt = {"prompt": "one two three four five six seven eight nine ten"}
    assert complete(**long_prompt, truncate_prompt_tokens=4)["usage"]["prompt_tokens"] == 4
    # min-p 1 keeps only the likeliest token: sampling at any temperature decodes greedily
    unbiased = {"logit_bias": None, "max_tokens": 16}
    assert complete(**unbiased, temperature=1.5, seed=3, min_p=1.0)["choices"] == complete(**unbiased)["choices"]


def test_return_token_ids_gives_the_prompt_and_output_tokens(base_url: str) -> None:
    """vLLM's return_token_ids: the prompt's tokens are /tokenize's, the output's are those counted
    as completion tokens; streamed, the prompt's go on the first chunk only and the chunks' own add
    up to the whole output's."""
    prompt = "Once upon a time"
    messages = [{"role": "user", "content": "Count: one two three"}]
    prompt_ids = requests.post(f"{base_url}/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"]
    chat_ids = requests.post(f"{base_url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    common = {"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    completion = requests.post(f"{base_url}/v1/completions", json={**common, "prompt": prompt}, timeout=60).json()
    [choice] = completion["choices"]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == completion["usage"]["completion_tokens"]
    text = requests.post(f"{base_url}/detokenize", json={"tokens": choice["token_ids"]}, timeout=60).json()["prompt"]
    assert text.startswith(choice["text"])
    chat = _chat(base_url, **common).json()
    assert chat["prompt_token_ids"] == chat_ids and len(chat["choices"][0]["token_ids"]) == chat["usage"][
        "completion_tokens"]
    plain = _chat(base_url, max_tokens=12, temperature=0).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None

    events = [e for e in _sse(_chat(base_url, **common, stream=True, stream_options={"include_usage": True}))
              if e != "[DONE]"]
    assert events[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == chat["choices"][0]["token_ids"]
    r = requests.post(f"{base_url}/v1/completions", json={**common, "prompt": prompt, "stream": True}, stream=True,
                      timeout=60)
    chunks = [e["choices"][0] for e in _sse(r) if e != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    r = requests.post(f"{base_url}/v1/completions", json={**common, "prompt": prompt, "stream": True,
                                                           "return_token_ids": False}, stream=True, timeout=60)
    assert all("token_ids" not in e["choices"][0] for e in _sse(r) if e != "[DONE]")


def test_tokenize_and_detokenize(base_url: str, client) -> None:
    """The tokens /tokenize returns are the ones generation counts as the prompt."""
    prompt = "Once upon a time"
    tokens = requests.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": prompt,
                                                         "return_token_strs": True}, timeout=60).json()
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert tokens["count"] == len(tokens["tokens"]) == completion.usage.prompt_tokens == len(tokens["token_strs"])
    models = requests.get(f"{base_url}/v1/models", timeout=30).json()
    assert tokens["max_model_len"] == models["data"][0]["max_model_len"]
    text = requests.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=60).json()
    assert text["prompt"].endswith(prompt)
    bare = requests.post(f"{base_url}/tokenize", json={"prompt": prompt, "add_special_tokens": False},
                         timeout=60).json()
    assert requests.post(f"{base_url}/detokenize", json={"tokens": bare["tokens"]}, timeout=60).json() == {
        "prompt": prompt}
    messages = [{"role": "user", "content": "Count: one two three"}]
    chat = requests.post(f"{base_url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat["token_strs"] is None
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert chat["count"] == answer.usage.prompt_tokens > tokens["count"]
    opened = requests.post(f"{base_url}/tokenize", json={"messages": messages, "add_generation_prompt": False},
                           timeout=60).json()
    assert opened["tokens"] == chat["tokens"][: opened["count"]] and opened["count"] < chat["count"]
    for path, bad, param in [("tokenize", {"prompt": prompt, "messages": messages}, "messages"),
                             ("tokenize", {}, "messages"),
                             ("tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
                             ("tokenize", {"prompt": prompt, "extra": 1}, "extra"),
                             ("detokenize", {"tokens": [10**9]}, "tokens"),
                             ("detokenize", {"tokens": [-1]}, "tokens[0]")]:
        r = requests.post(f"{base_url}/{path}", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    r = requests.post(f"{base_url}/tokenize", json={"model": "nope", "prompt": prompt}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_n_choices_streamed_and_not(client) -> None:
    """Choice i draws from seed + i: each equals a single request with that seed, streamed alike.
    Four tokens share the mass (a bias), so a float32 row's last bits, which differ between a
    batch of three and one alone, cannot move a draw across a token's boundary."""
    common = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 16,
              "temperature": 1.0, "logit_bias": {str(t): 100 for t in range(1000, 1004)},
              "extra_body": {"ignore_eos": True, "speculation": {"drafter": "none"}}}
    full = client.chat.completions.create(n=3, seed=7, **common)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    singles = [client.chat.completions.create(seed=7 + i, **common) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert len(set(texts)) > 1  # sampled: the choices differ
    assert full.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert full.usage.completion_tokens == 3 * 16
    chunks = list(client.chat.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True},
                                                 **common))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role) == [0, 1, 2]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].usage == full.usage
    chunks = list(client.chat.completions.create(n=3, seed=7, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **common))  # vLLM's: each chunk, its usage so far
    for i in range(3):
        usages = [c.usage for c in chunks if c.choices and c.choices[0].index == i]
        assert {u.prompt_tokens for u in usages} == {full.usage.prompt_tokens}
        counts = [u.completion_tokens for u in usages]
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 16 and len(set(counts)) > 2
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert chunks[-1].usage == full.usage
    completions = client.completions.create(model=MODEL, prompt="Once", n=2, max_tokens=8, temperature=0)
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text  # greedy: the same twice


def test_sse_wire_format(base_url: str) -> None:
    with requests.post(f"{base_url}/v1/completions", stream=True, timeout=60,
                       json={"model": MODEL, "prompt": "abc", "stream": True, **GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(_sse(r))
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] and "speculation" in events[-2]


def test_stop_string_streamed_and_not(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "The list:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = requests.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert len(text) > 12
    stop = text[8:11]
    body["stop"] = [stop, "\x00never"]
    out = requests.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == text[: text.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["stop_reason"] == stop
    with requests.post(f"{base_url}/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=60) as r:
        events = [e for e in _sse(r) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == out["choices"][0]["text"]
    assert [e["choices"][0]["stop_reason"] for e in events][-1] == stop
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "The list:"}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    answer = requests.post(f"{base_url}/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    stop = answer["message"]["content"][8:11]
    stopped = requests.post(f"{base_url}/v1/chat/completions", json={**chat, "stop": [stop]}, timeout=60).json()
    assert stopped["choices"][0]["stop_reason"] == stop and answer["stop_reason"] is None


def test_drafters_are_lossless_and_stats_consistent(base_url: str) -> None:
    body = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    results = {d: _chat(base_url, speculation={"drafter": d}, **body).json()
               for d in ("none", "ngram", "self")}
    texts = {d: r["choices"][0]["message"]["content"] for d, r in results.items()}
    assert texts["none"] == texts["ngram"] == texts["self"]
    for drafter, r in results.items():
        spec, usage = r["speculation"], r["usage"]
        assert spec["drafter"] == drafter
        assert usage["completion_tokens"] == 48 and r["choices"][0]["finish_reason"] == "length"
        # every step emits its accepted tokens plus one (ignore_eos, so nothing was trimmed)
        assert spec["num_steps"] + spec["num_accepted_tokens"] == usage["completion_tokens"]
        assert spec["mean_acceptance_length"] == round(usage["completion_tokens"] / spec["num_steps"], 4)
        assert sum(spec["acceptance_histogram"]) == spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        hist = spec["acceptance_histogram"]
        assert all(a >= b for a, b in zip(hist, hist[1:]))  # reaching position i+1 passes position i
    assert results["none"]["speculation"] | {"drafters": None} == results["none"]["speculation"] | {
        "draft_len": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "acceptance_histogram": [],
        "drafters": None, "num_steps": 48}
    self_spec = results["self"]["speculation"]  # a drafter identical to the target: all accepted
    assert self_spec["reason"] == "forced" and self_spec["drafters"] == ["self"]
    assert {drafter for drafter, _, _ in self_spec["schedule"]} <= {"self", "none"}  # none: the clipped last step
    assert self_spec["num_accepted_tokens"] == self_spec["num_draft_tokens"] > 0


def test_prediction_drafts_and_reports_usage(client) -> None:
    """A prediction (OpenAI's Predicted Outputs) drafts but never changes the output; usage counts
    the predicted tokens accepted and rejected, streamed or not, for a string or text parts."""
    common = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 32,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**common)
    assert plain.usage.completion_tokens_details is None  # no prediction, no prediction counts
    text = plain.choices[0].message.content
    for content in (text, [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]):
        prediction = {"type": "content", "content": content}
        forced = {**common, "extra_body": {**common["extra_body"], "speculation": {"drafter": "prediction", "draft_len": 8}}}
        out = client.chat.completions.create(prediction=prediction, **forced)
        assert out.choices[0].message.content == text
        details = out.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 16 and details.rejected_prediction_tokens >= 0
        assert out.speculation["drafters"] == ["prediction"]
        chunks = list(client.chat.completions.create(prediction=prediction, stream=True,
                                                     stream_options={"include_usage": True}, **forced))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage == out.usage
    routed = client.chat.completions.create(prediction={"type": "content", "content": text}, **common)
    assert routed.choices[0].message.content == text
    assert routed.usage.completion_tokens_details is not None
    completion = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=0,
                                      extra_body={"prediction": {"type": "content", "content": completion.choices[0].text}})
    assert again.choices[0].text == completion.choices[0].text


def test_structured_outputs_match_their_format(client, base_url: str) -> None:
    """OpenAI's json_schema and json_object and vLLM's structured_outputs, on chat and completions,
    streamed and not: the output matches, and speculation does not change it."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    common = {"model": MODEL, "messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": 40,
              "temperature": 0}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    out = client.chat.completions.create(response_format=response_format, **common)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert set(json.loads(text)) == {"name", "age"}
    for drafter in ("self", "other", "ngram"):
        forced = client.chat.completions.create(response_format=response_format,
                                                extra_body={"speculation": {"drafter": drafter, "draft_len": 3}},
                                                **common)
        assert forced.choices[0].message.content == text
    chunks = list(client.chat.completions.create(response_format=response_format, stream=True, **common))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    anything = client.chat.completions.create(response_format={"type": "json_object"}, **common).choices[0]
    assert anything.message.content.startswith("{")  # the random target may fill max_tokens inside it
    assert anything.finish_reason == "length" or isinstance(json.loads(anything.message.content), dict)

    choice = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert choice.choices[0].text in {"red", "green", "blue"}
    regex = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Date:", "max_tokens": 16, "temperature": 0.8, "seed": 3,
        "structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}}).json()
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", regex["choices"][0]["text"]), regex
    lark = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Sum:", "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "text"}, "structured_outputs": {"grammar": 'start: num " + " num\nnum: /[1-9]/'}})
    assert re.fullmatch(r"[1-9] \+ [1-9]", lark.json()["choices"][0]["text"]), lark.text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters


def test_tool_calls_named_and_required_streamed_and_not(client) -> None:
    """Tool calls decoded under their schemas: a named function's arguments, or "required" calls of
    any tool; the openai client parses both, streamed (the calls whole in the last chunk) or not."""
    common = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
              "temperature": 0, "tools": [WEATHER, NOW]}
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           **common)
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F")
    drafted = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             extra_body={"speculation": {"drafter": "self", "draft_len": 3}},
                                             **common)
    assert drafted.choices[0].message.tool_calls[0].function.arguments == call.function.arguments

    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **common).choices[0]
    assert required.finish_reason in ("tool_calls", "length")
    if required.finish_reason == "tool_calls":
        (call,) = required.message.tool_calls  # parallel_tool_calls false: exactly one
        assert call.function.name in ("get_weather", "now") and isinstance(json.loads(call.function.arguments), dict)
    else:  # max_tokens cut the array short: the text, unparsed
        assert required.message.tool_calls is None and required.message.content.startswith("[")

    chunks = list(client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **common))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and all(d.tool_calls is None for d in deltas[:-1])
    (streamed,) = deltas[-1].tool_calls
    assert streamed.index == 0 and streamed.function.arguments == arguments_text(named)
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(tool_choice="none", **common).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


def test_an_assistant_message_continued_and_echoed_streamed_and_not(client) -> None:
    """vLLM's continue_final_message with add_generation_prompt false: the output continues the
    assistant message the client started; `echo` starts the content with it."""
    common = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [
        {"role": "user", "content": "Count: one two"}, {"role": "assistant", "content": "three four"}],
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False, "echo": True}}
    content = client.chat.completions.create(**common).choices[0].message.content
    assert content.startswith("three four") and len(content) > len("three four")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **common) if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == "three four"
    assert "".join(d.content or "" for d in deltas) == content
    common["extra_body"]["echo"] = False
    assert client.chat.completions.create(**common).choices[0].message.content == content[len("three four"):]


def test_tool_choice_auto_calls_or_answers_streamed_and_not(client) -> None:
    """"auto", the default with tools: the model calls tools or answers, under one grammar; an
    answer streams as content deltas that add up to the message the same request gets unstreamed,
    calls go out whole (an answer max_tokens cuts short keeps what it wrote). Sampled over seeds,
    the tiny model does both. A seed repeats a sampled output where the target computes its rows
    alike: this float32 one does only in calls of the same shape, so the drafter and k are pinned."""
    kinds = set()
    pinned = {"speculation": {"drafter": "ngram", "draft_len": 3}}
    for seed in range(12):
        common = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
                  "temperature": 1.0, "seed": seed, "tools": [WEATHER, NOW], "extra_body": pinned}
        choice = client.chat.completions.create(**common).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **common))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = "".join(d.content or "" for d in deltas)
        if choice.message.tool_calls is not None:
            kinds.add("calls")
            assert choice.finish_reason == "tool_calls" and choice.message.content is None and not streamed
            assert [c.function.name for c in choice.message.tool_calls] == \
                   [c.function.name for c in deltas[-1].tool_calls]
            assert all(c.function.name in ("get_weather", "now") for c in choice.message.tool_calls)
        else:
            kinds.add("answer" if choice.finish_reason == "stop" else "cut")
            assert choice.finish_reason in ("stop", "length") and streamed == choice.message.content
            assert all(d.tool_calls is None for d in deltas)
    assert "calls" in kinds and kinds & {"answer", "cut"}  # the random model's answers run to max_tokens


def test_a_conversation_goes_on_after_a_tool_call(base_url: str) -> None:
    """The agent's loop: the assistant's call and the tool's result sent back; a call that is not
    OpenAI's shape is a 400 naming it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None,
                "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    r = _chat(base_url, messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    messages[1]["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"arguments": "{}"}}]
    r = _chat(base_url, messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.name", r.text


def _response_events(base_url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed /v1/responses' (event name, data) pairs, the names checked against the types."""
    with requests.post(f"{base_url}/v1/responses", json={**body, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.text.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def test_responses_answer_as_chat_does_streamed_and_not(client, base_url: str) -> None:
    """/v1/responses is the chat path: the same text, tokens and speculation as the chat request
    it stands for; the openai client parses both the response and its events."""
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one two three"}])
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Count: one two three", "max_output_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    response = client.responses.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True})
    assert response.output_text == chat.choices[0].message.content and response.output[0].type == "message"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens, 24)
    assert response.usage.total_tokens == 24 + chat.usage.prompt_tokens
    events = _response_events(base_url, body)
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == response.output_text == events[-4][1]["text"]
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == response.output_text
    assert events[-1][1]["response"]["speculation"]["num_steps"] >= 1
    ignored = {"stream_options": {"include_obfuscation": False}, "prompt_cache_key": "c-1", "max_tool_calls": 2,
               "prompt_cache_retention": "24h", "safety_identifier": "u-1"}  # OpenAI's, changing nothing here
    streamed = list(client.responses.create(stream=True, **{k: v for k, v in body.items() if k != "ignore_eos"},
                                            **ignored, extra_body={"ignore_eos": True}))
    assert [e.type for e in streamed] == names
    # the items a client sends back (an earlier answer, as output_text parts) continue the conversation
    followed = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Count: one two three"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": response.output_text}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Again"}]}])
    again = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Count: one two three"}, {"role": "assistant", "content": response.output_text},
        {"role": "user", "content": "Again"}])
    assert followed.output_text == again.choices[0].message.content


def test_responses_include_the_outputs_logprobs_streamed_and_not(client, base_url: str) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the output text's tokens'
    logprobs, the chat's for the same request; streamed, the text deltas carry them in order."""
    body = {"model": MODEL, "input": "Count: one two three", "max_output_tokens": 12, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = client.responses.create(**body, extra_body={"ignore_eos": True})
    logprobs = response.output[0].content[0].logprobs
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": body["input"]}],
                                          max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert [(t.token, t.logprob) for t in logprobs] == [(t.token, t.logprob) for t in chat.choices[0].logprobs.content]
    assert len(logprobs) == 12 and all(len(t.top_logprobs) == 2 for t in logprobs)
    assert "".join(t.token for t in logprobs) == response.output_text
    events = _response_events(base_url, {**body, "ignore_eos": True})
    streamed = [t for name, data in events if name == "response.output_text.delta" for t in data["logprobs"]]
    done = next(data for name, data in events if name == "response.output_text.done")
    assert [t["logprob"] for t in streamed] == [t["logprob"] for t in done["logprobs"]] == [t.logprob for t in logprobs]
    plain = client.responses.create(**{k: v for k, v in body.items() if k not in ("include", "top_logprobs")})
    assert plain.output[0].content[0].logprobs == []


def test_responses_call_functions_and_read_their_outputs(client, base_url: str) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [tool], "tool_choice": "required",
            "max_output_tokens": 60, "temperature": 0}
    response = client.responses.create(**body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and set(json.loads(c.arguments)) == {"city", "unit"} for c in calls)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    assert [c.arguments for c in calls] == [c.function.arguments for c in chat.choices[0].message.tool_calls]
    events = _response_events(base_url, body)
    done = [data for name, data in events if name == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == [c.arguments for c in calls]
    assert events[-1][0] == "response.completed"
    named = client.responses.create(**{**body, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [item.type for item in named.output] == ["function_call"]
    # the agent sends the call and its output back: the conversation goes on, as on chat
    call = calls[0]
    turn = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, tools=[tool], tool_choice="none",
                                   input=[{"role": "user", "content": "Weather in Paris?"},
                                          {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                           "arguments": call.arguments},
                                          {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    chat_turn = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER],
                                               tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}])
    assert turn.output_text == chat_turn.choices[0].message.content
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    person = client.responses.create(model=MODEL, input="A person as JSON", max_output_tokens=40, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert set(json.loads(person.output_text)) == {"name"}


def test_responses_are_stored_continued_read_and_deleted(client, base_url: str) -> None:
    """A stored response's conversation goes on by `previous_response_id` as if the client had sent
    it whole (without the first's instructions, as OpenAI); a streamed one is stored too; GET reads
    a response, DELETE forgets it, and one sent with `store: false` is not kept."""
    common = {"model": MODEL, "max_output_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.responses.create(instructions="Be brief.", input="Count: one two three", **common)
    assert first.store and first.previous_response_id is None
    follow = client.responses.create(previous_response_id=first.id, input="Again", **common)
    whole = client.responses.create(store=False, input=[
        {"role": "user", "content": "Count: one two three"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "Again"}], **common)
    assert follow.previous_response_id == first.id and not whole.store
    assert (follow.output_text, follow.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    events = _response_events(base_url, {"model": MODEL, "input": "Hello", "max_output_tokens": 4, "temperature": 0,
                                         "previous_response_id": follow.id})
    streamed = events[-1][1]["response"]
    assert client.responses.retrieve(streamed["id"]).output_text == streamed["output"][0]["content"][0]["text"]
    assert streamed["usage"]["input_tokens"] > follow.usage.input_tokens
    r = requests.delete(f"{base_url}/v1/responses/{first.id}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": first.id, "object": "response", "deleted": True}, r.text
    for gone in (first.id, whole.id):
        r = requests.get(f"{base_url}/v1/responses/{gone}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = requests.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                         "previous_response_id": first.id}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert requests.delete(f"{base_url}/v1/responses/{first.id}", timeout=30).status_code == 404


def test_a_responses_input_items_are_listed_in_pages(client, base_url: str) -> None:
    """GET /v1/responses/{id}/input_items lists the items a response was generated from, the earlier
    turns included, the newest first unless asked otherwise, in pages the SDK follows; an item
    keeps its id from one turn to the next."""
    common = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(input="Count: one two three", **common)
    follow = client.responses.create(previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Again"}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}], **common)
    [asked] = client.responses.input_items.list(first.id).data
    assert (asked.type, asked.role, asked.content[0].type, asked.content[0].text) == (
        "message", "user", "input_text", "Count: one two three")
    items = list(client.responses.input_items.list(follow.id, order="asc", limit=2))  # the SDK pages through
    assert [item.type for item in items] == ["message", "message", "message", "function_call_output"]
    assert items[0].id == asked.id and items[1].id == first.output[0].id and items[1].content[0].text == \
        first.output_text
    assert (items[2].content[0].text, items[3].output) == ("Again", "18 C")
    assert len({item.id for item in items}) == 4
    newest = client.responses.input_items.list(follow.id, limit=3)
    assert [item.id for item in newest.data] == [item.id for item in items[:0:-1]] and newest.has_more
    r = requests.get(f"{base_url}/v1/responses/{follow.id}/input_items", params={"after": items[1].id}, timeout=30)
    assert r.status_code == 200 and [i["id"] for i in r.json()["data"]] == [items[0].id], r.text
    assert (r.json()["first_id"], r.json()["last_id"], r.json()["has_more"]) == (items[0].id, items[0].id, False)
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after")):
        r = requests.get(f"{base_url}/v1/responses/{follow.id}/input_items", params=params, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = requests.get(f"{base_url}/v1/responses/resp_nope/input_items", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_a_background_response_is_polled_and_one_still_generated_is_cancelled(client, base_url: str) -> None:
    """`background: true` answers at once, `queued`, and generates meanwhile: GET then reads what
    a synchronous request answers. One cancelled while it is generated is stored `cancelled` and
    leaves the worker (an abort), as one deleted does; a finished one cannot be cancelled, nor
    continued while running."""
    common = {"model": MODEL, "input": "Count: one two three", "max_output_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    queued = client.responses.create(background=True, **common)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    wait_for(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"),
             "the background response", 60, every_s=0.1)
    done, sync = client.responses.retrieve(queued.id), client.responses.create(store=False, **common)
    assert (done.status, done.output_text, done.usage.output_tokens) == (sync.status, sync.output_text, 8)
    r = requests.post(f"{base_url}/v1/responses/{done.id}/cancel", timeout=30)
    assert r.status_code == 400 and "incomplete" in r.json()["error"]["message"], r.text

    aborted = num_finished(base_url, "abort")
    running = client.responses.create(background=True, model=MODEL, input="Long:", max_output_tokens=900,
                                       temperature=0, extra_body={"ignore_eos": True})
    r = requests.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "x",
                                                         "previous_response_id": running.id}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    r = requests.post(f"{base_url}/v1/responses/{running.id}/cancel", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert client.responses.retrieve(running.id).status == "cancelled"
    wait_for(lambda: num_finished(base_url, "abort") == aborted + 1, "the worker to abort the request", 30)
    deleted = client.responses.create(background=True, model=MODEL, input="Long:", max_output_tokens=900,
                                       temperature=0, extra_body={"ignore_eos": True})
    client.responses.delete(deleted.id)  # one still generated stops as well
    wait_for(lambda: num_finished(base_url, "abort") == aborted + 2, "the worker to abort the deleted one", 30)
    r = requests.get(f"{base_url}/v1/responses/{deleted.id}", timeout=30)
    assert r.status_code == 404, r.text


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "stream"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].message.content"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x" * 20 + "lorem ipsum " * 600}, "input"),
    ({"temperatur": 1}, "temperatur"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
])
def test_bad_responses_request_is_400_naming_the_field(base_url: str, body: dict, param: str) -> None:
    r = requests.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def _message_events(base_url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed /v1/messages' (event name, data) pairs, the names checked against the types."""
    with requests.post(f"{base_url}/v1/messages", json={**body, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.text.split("\n\n") if b.strip()]
    events = [(name[len("event: "):], json.loads(data[len("data: "):]))
              for name, data in (block.split("\n") for block in blocks)]
    assert all(name == data["type"] for name, data in events)
    return events


def test_messages_answer_as_chat_does_streamed_and_not(client, base_url: str) -> None:
    """Anthropic's /v1/messages is the chat path: the same text as the chat request it stands for;
    the anthropic client parses the message and its stream; stop sequences are named."""
    import anthropic

    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one two three"}])
    body = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "Count: one two three"}],
            "max_tokens": 24}
    greedy = {"temperature": 0, "ignore_eos": True}  # sampling fields this SDK no longer sends itself
    message = claude.messages.create(**body, extra_body=greedy)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 24
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert message.model_extra["speculation"]["num_steps"] >= 1
    with claude.messages.stream(**body, extra_body=greedy) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text and streamed.stop_reason == "max_tokens"
    events = _message_events(base_url, {**body, **greedy})
    assert [name for name, _ in events][:2] == ["message_start", "content_block_start"]
    assert [name for name, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["usage"]["output_tokens"] == 24

    # a prefill: the last assistant message's text is where the answer starts, as on chat's continue_final_message
    start = message.content[0].text[:6]
    prefilled = claude.messages.create(**{**body, "messages": [*body["messages"], {"role": "assistant",
                                                                                   "content": start}]},
                                       extra_body=greedy)
    continued = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=[{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Count: one two three"},
                                                             {"role": "assistant", "content": start}],
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    assert prefilled.content[0].text == continued.choices[0].message.content

    stop = message.content[0].text[8:11]
    stopped = claude.messages.create(**body, stop_sequences=["\x00never", stop], extra_body=greedy)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == message.content[0].text[: message.content[0].text.index(stop)]
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=body["messages"])
    assert counted.input_tokens == chat.usage.prompt_tokens
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    person = claude.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "A person"}],
                                    output_config={"format": {"type": "json_schema", "schema": schema}},
                                    extra_body={"temperature": 0})
    assert set(json.loads(person.content[0].text)) == {"name"} and person.stop_reason == "end_turn"


def test_messages_call_tools_and_read_their_results(client, base_url: str) -> None:
    import anthropic

    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    function = WEATHER["function"]
    tool = {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
            "tool_choice": {"type": "any"}, "max_tokens": 60}
    message = claude.messages.create(**body, extra_body={"temperature": 0})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and all(set(u.input) == {"city", "unit"} for u in uses)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    assert [u.input for u in uses] == [json.loads(c.function.arguments) for c in chat.choices[0].message.tool_calls]
    events = _message_events(base_url, {**body, "temperature": 0})
    partial = [data["delta"]["partial_json"] for name, data in events
               if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta"]
    assert [json.loads(p) for p in partial] == [u.input for u in uses]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with claude.messages.stream(**body, extra_body={"temperature": 0}) as stream:
        assert [b.input for b in stream.get_final_message().content if b.type == "tool_use"] == [u.input for u in uses]
    named = claude.messages.create(**{**body, "tool_choice": {"type": "tool", "name": "get_weather"}},
                                   extra_body={"temperature": 0})
    assert [b.type for b in named.content] == ["tool_use"]
    # the agent sends the call and its result back: the conversation goes on, as on chat
    use = uses[0]
    turn = claude.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, tools=[tool],
                                  tool_choice={"type": "none"},
                                  messages=[{"role": "user", "content": "Weather in Paris?"},
                                            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                                                               "name": use.name, "input": use.input}]},
                                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                          "content": "18 C"}]}])
    chat_turn = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER],
                                               tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C"}])
    assert turn.content[0].text == chat_turn.choices[0].message.content


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, 400, "tools"),
    ({"tool_choice": {"type": "tool"}}, 400, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice"),  # no tools to call
    ({"stop_sequences": ["x"] * 9}, 400, "stop_sequences"),
    ({"container": "c_1"}, 400, "container"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, 400, "output_config"),
    ({"max_tokens": 5000}, 400, "max_tokens"),
    ({"model": "nope"}, 404, "nope"),
])
def test_bad_messages_request_is_refused_in_anthropics_shape(base_url: str, body: dict, status: int,
                                                               needle: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body}
    r = requests.post(f"{base_url}/v1/messages", json={k: v for k, v in request.items() if v is not None}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert needle in error["error"]["message"], error


def arguments_text(response) -> str:
    return response.choices[0].message.tool_calls[0].function.arguments


def test_draft_len_and_seeded_sampling(base_url: str) -> None:
    r = _chat(base_url, speculation={"drafter": "self", "draft_len": 2}, **GREEDY).json()
    assert r["speculation"]["draft_len"] == 2 and len(r["speculation"]["acceptance_histogram"]) <= 2
    sampled = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7, "max_tokens": 24}
    # a seed reproduces sampled output for the same drafter schedule: fix k (an adaptive k
    # follows live statistics, which the first request changes)
    a, b = (_chat(base_url, speculation={"drafter": "other", "draft_len": 3}, **sampled).json() for _ in range(2))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_concurrent_streams_interleave(base_url: str) -> None:
    """B starts while A is generating; B's first token arrives before A finishes, and A keeps
    producing tokens while B runs: the replica interleaves steps, nobody waits for a whole request."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    a_started = threading.Event()

    def run(name: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"Request {name}:", "stream": True, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "speculation": {"drafter": "none"}}
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200, r.text
            for event in _sse(r):
                with lock:
                    events.append((name, "done" if event == "[DONE]" else "chunk"))
                a_started.set() if name == "A" else None

    a = threading.Thread(target=run, args=("A", 600))
    a.start()
    assert a_started.wait(60)
    b = threading.Thread(target=run, args=("B", 60))
    b.start()
    a.join(120)
    b.join(120)
    assert ("A", "done") in events and ("B", "done") in events
    b_first = events.index(("B", "chunk"))
    a_done = events.index(("A", "done"))
    assert b_first < a_done  # B did not wait for A to finish
    assert ("A", "chunk") in events[b_first:a_done]  # and A was not paused while B ran


def test_client_disconnect_frees_the_request(base_url: str) -> None:
    from ray import serve

    worker = serve.get_deployment_handle("TargetWorker", app_name="specroute")
    before = worker.status.remote().result()
    aborted = num_finished(base_url, "abort")
    body = {"model": MODEL, "prompt": "Long:", "stream": True, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "speculation": {"drafter": "none"}}
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60) as r:
        next(_sse(r))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = worker.status.remote().result()
        if status["num_active"] == 0 and status["num_cancelled"] > before["num_cancelled"]:
            break
        time.sleep(0.2)
    assert status["num_cancelled"] == before["num_cancelled"] + 1, status
    assert status["num_finished"] == before["num_finished"] and status["num_active"] == 0
    assert num_finished(base_url, "abort") == aborted + 1  # vLLM's request_success_total{finished_reason}
    assert " -- Cancelled request: the client went away" in _worker_log()


def test_the_worker_logs_vllm_stats_lines(base_url: str) -> None:
    """vLLM's periodic stats lines, in the replica's Serve log (at INFO, while Serve itself logs
    warnings only) once a second of serving is over (this app's interval)."""
    body = {"model": MODEL, "prompt": "a b c d a b c d a b c d a b c d", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "speculation": {"drafter": "self", "draft_len": 3}}
    assert requests.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    throughput = re.compile(r"INFO .* -- Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
                            r"[\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, "
                            r"Prefix cache hit rate: (-|[\d.]+%)$", re.M)
    spec = re.compile(r"INFO .* -- SpecDecoding metrics: Mean acceptance length: [\d.]+, Accepted: \d+ tokens, "
                      r"Drafted: [1-9]\d* tokens, Per-position acceptance rate: [\d.]+, [\d.]+, [\d.]+, "
                      r"Avg Draft acceptance rate: [\d.]+%, Steps by drafter: .*\bself \d+%", re.M)
    deadline = time.monotonic() + 30
    while not (throughput.search(text := _worker_log()) and spec.search(text)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert throughput.search(text) and spec.search(text), text[-3000:]
    assert " -- CALL " not in text  # Serve's own access lines (INFO) stay quiet


def test_the_worker_logs_each_request_under_its_request_id(base_url: str) -> None:
    """`log_requests` (vLLM's): a line when a request arrives and when it finishes, each carrying
    the request id the client got in `x-request-id` (Serve's log format)."""
    prompt = f"Log me {time.monotonic_ns()}: one two three"
    r = requests.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "seed": 3})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    received = re.compile(rf"INFO .* {re.escape(rid)} -- Received request: prompt: {re.escape(repr(prompt))}, "
                          r"params: \{max_tokens=7, .*seed=3")
    finished = re.compile(rf"INFO .* {re.escape(rid)} -- Finished request: length, \d+ prompt tokens \(\d+ cached\), "
                          r"7 output tokens in \d+ steps \(mean acceptance length [\d.]+; drafters .*\), "
                          r"TTFT [\d.]+ s, total [\d.]+ s")
    deadline = time.monotonic() + 30
    while not (received.search(text := _worker_log()) and finished.search(text)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert received.search(text) and finished.search(text), text[-3000:]


def _worker_log() -> str:
    logs = Path("/tmp/ray/session_latest/logs/serve")
    return "".join(f.read_text(errors="replace") for f in logs.glob("replica_specroute_TargetWorker_*.log"))


def test_run_batch_against_a_running_server(base_url: str, tmp_path: Path) -> None:
    """`specroute run-batch --url`: a batch file's requests answered by the running service, as
    each would be alone (tests/test_run_batch.py starts a service of its own)."""
    from router.cli import main

    body = {"model": MODEL, "prompt": "Count: one two three", "max_tokens": 10, "temperature": 0}
    alone = requests.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {**body, "speculation": {"drafter": ("none", "ngram", "auto")[i % 3]}}} for i in range(6)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["run-batch", "-i", str(src), "-o", str(out), "--url", base_url, "--concurrency", "4"])
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0, [g["error"] or g["response"] for g in got if g["error"] or g["response"]["status_code"] != 200]
    assert [g["custom_id"] for g in got] == [f"r{i}" for i in range(6)]
    assert {g["response"]["status_code"] for g in got} == {200}
    assert {g["response"]["body"]["choices"][0]["text"] for g in got} == {alone}


def test_any_origin_may_call_by_default(base_url: str) -> None:
    """CORS as vLLM's defaults have it: a page of any origin may call the API."""
    url = f"{base_url}/v1/completions"
    preflight = requests.options(url, headers={"Origin": "https://notebook.example",
                                              "Access-Control-Request-Method": "POST"}, timeout=30)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    r = requests.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60,
                      headers={"Origin": "https://notebook.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# -- errors ------------------------------------------------------------------------------------------
LONG_PROMPT = "lorem ipsum " * 600  # > 1024 tokens, the tiny config's max_model_len


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"messages": None}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat", {"n": 20}, "n"),
    ("chat", {"n": 2, "speculation": {"drafter": "nope"}, "stream": True}, "speculation.drafter"),
    ("chat", {"speculation": {"drafter": "nope"}}, "speculation.drafter"),
    ("chat", {"speculation": {"drafter": "nope"}, "stream": True}, "speculation.drafter"),
    ("chat", {"speculation": {"draft_len": 0}}, "speculation.draft_len"),
    ("chat", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("completions", {"prompt": LONG_PROMPT, "stream": True}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # without echo: nothing to answer
    ("completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "hi", "stop": 3}, "stop"),
    ("chat", {"prediction": "x"}, "prediction"),
    ("chat", {"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),  # "auto" by default
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("completions", {"prompt": "hi", "structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ("completions", {"prompt": "hi", "structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ("completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ("chat", {"prediction": {"type": "file", "content": "x"}}, "prediction.type"),
    ("chat", {"priority": 3}, "priority"),  # the app schedules first come first served
    ("chat", {"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true
    ("chat", {"tools": [WEATHER], "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "prediction": {"type": "content", "content": "lorem ipsum " * 600}},
     "prediction"),
    ("completions", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ("completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"prompt": "hi", "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ("chat", {"stop_token_ids": [10**9]}, "stop_token_ids"),
    ("chat", {"bad_words": ["  "]}, "bad_words"),
    ("chat", {"bad_words": ["x"], "response_format": {"type": "json_object"}}, "bad_words"),
    ("chat", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("chat", {"cache_salt": ""}, "cache_salt"),
    ("completions", {"prompt": "hi", "cache_salt": 7}, "cache_salt"),
])
def test_bad_request_is_400_naming_the_field(base_url: str, path: str, body: dict, param: str) -> None:
    default = {"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else {}
    body = {"model": MODEL, **default, **body}
    if body.get("messages", "") is None:
        del body["messages"]
    url = f"{base_url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    r = requests.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_openai_client_raises_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=20)
    assert info.value.status_code == 400 and info.value.body["param"] == "n"


def test_unknown_model_is_404(base_url: str, client) -> None:
    r = _chat(base_url, model="gpt-5")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x")


def test_malformed_json_and_unknown_route(base_url: str) -> None:
    r = requests.post(f"{base_url}/v1/completions", data=b"{not json", timeout=10,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.get(f"{base_url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


# -- the worker's text deltas (no server) ------------------------------------------------------------
@pytest.mark.parametrize(("text", "sent", "stop", "delta"), [
    ("abc", "", (), "abc"),
    ("abc\ufffd", "", (), "abc"),  # an incomplete UTF-8 character waits for its next byte
    ("abc\n", "", ("\n\n",), "abc"),  # may become the stop string: held back
    ("abc\nd", "abc", ("\n\n",), "\nd"),
    ("say EN", "say", ("END", "x"), " "),
    ("abc", "abc", ("c",), ""),
])
def test_stream_delta(text: str, sent: str, stop: tuple[str, ...], delta: str) -> None:
    from workers.text_stream import stream_delta

    assert stream_delta(text, sent, stop) == delta


def test_worker_errors_map_to_openai_errors() -> None:
    from router.app import _as_api_error
    from workers.result import RequestError

    bad = _as_api_error(RequestError("too long", "messages", "context_length_exceeded")).body.error
    assert (bad.message, bad.param, bad.code, bad.type) == (
        "too long", "messages", "context_length_exceeded", "invalid_request_error")
    crash = _as_api_error(RuntimeError("boom"))
    assert crash.status == 500 and crash.body.error.type == "internal_error"
    assert crash.body.error.message == "internal error: RuntimeError: boom"  # what a client can report
    assert len(_as_api_error(RuntimeError("x" * 10_000)).body.error.message) == 500


def test_load_run_against_the_app(base_url: str, tmp_path: Path) -> None:
    """`specroute load`'s client on the real app: concurrent streams, no errors, timings in
    order, a report per mode."""
    from bench.load import LoadArgs, long_prompt_text, run_load, write_load_report
    from bench.prompts import BenchPrompt

    prompts = [BenchPrompt(i, "chat", text) for i, text in enumerate(["Hello there", "Count to five", "Say hi"])]
    long = long_prompt_text(prompts, 200)
    runs = [run_load(LoadArgs(base_url, prompts, clients=3, duration_s=3.0, max_tokens=8, speculation=mode,
                              model=MODEL, long_prompt=long)) for mode in ("none", "auto")]
    for run in runs:
        assert run["errors"] == 0 and run["requests"] >= 3, run
        assert run["completion_tokens"] > 0 and run["tokens_per_s"] > 0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] <= run["e2e_p99_s"]
        sent = run["long_prompt"]
        assert sent["ok"] and 150 < sent["prompt_tokens"] < 400, sent  # about the 200 tokens asked for (+ chat template)
        assert 0 < sent["ttft_s"] <= sent["e2e_s"]
    report = write_load_report(runs, tmp_path, "specroute load --test").read_text()
    assert report.count("| none |") == 1 and report.count("| auto |") == 1
    assert report.count("-token prompt (ok) had its first token after") == 2
