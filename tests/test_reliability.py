"""Reliability and security of the real Serve app over HTTP (docs/reliability.md is the table).

One app for the module, configured the way a production deployment would lock it down: an API key,
an admin token, a small request-size limit, a bounded queue (one request at a time on the worker,
one queued), and statistics and stored responses in a private Redis this module stops and
restarts. Tests run in file order: the ones that break things (Redis outages, replica kill) come
last.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
import yaml
from helpers import ThrowawayRedis, num_finished, serve_tiny_app, throwaway_redis_server, wait_for
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import not_a_server_error

from policies.paths import REPO_ROOT
from workers.config import EngineConfig

openai = pytest.importorskip("openai")

MODEL = "tiny-test-model"
API_KEY = "sk-test-inference-key"
ADMIN = "admin-test-token"
MAX_BODY = 16 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ORIGIN = "https://chat.example"  # the one origin whose pages may call this app
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
BACKGROUND_HELD = 3  # background responses the ingress holds
BACKGROUND_LEASE_S = 0.9  # renewed every 0.3 s
RUNNING = ("queued", "in_progress")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Count: one two three"}], "max_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThrowawayRedis]:
    """Statistics and stored responses live here; the fault tests stop it (SHUTDOWN SAVE) and
    restart it with its data."""
    with throwaway_redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def base_url(tiny_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory,
             redis_server: ThrowawayRedis) -> Iterator[str]:
    with serve_tiny_app(tiny_config, tmp_path_factory.mktemp("serve"), MODEL, api_key=API_KEY, admin_token=ADMIN,
                        max_request_bytes=MAX_BODY, max_ongoing_requests=1, max_queued_requests=1,
                        stats_url=redis_server.url, stats_prefix="reliability", responses_url=redis_server.url,
                        max_background_responses=BACKGROUND_HELD, background_lease_s=BACKGROUND_LEASE_S,
                        allowed_origins=[ORIGIN]) as url:
        yield url


def _post(base_url: str, path: str, body: object, headers: dict[str, str] | None = None, **kwargs) -> requests.Response:
    return requests.post(f"{base_url}{path}", json=body, headers=AUTH if headers is None else headers, timeout=60,
                         **kwargs)


def _assert_openai_error(r: requests.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def _worker_status() -> dict:
    from ray import serve

    worker = serve.get_deployment_handle("TargetWorker", app_name="specroute")
    return worker.broadcast("status").results(timeout_s=30)[0]  # bypasses the request queue


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "temperatur": 0.5}, "temperatur"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "contnet": "y"}]}, "messages[0].contnet"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nope"}}}], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "file_search"}], "tool_choice": "required"}, "tools[0].type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": "high"}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"dog": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"42": 101}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "bye"}, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {**CHAT, "moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("/v1/chat/completions", {**CHAT, "verbosity": "terse"}, "verbosity"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n"),
    ("/v1/chat/completions", {**CHAT, "stream": "maybe"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": "x" * 1000}, "stop"),
    ("/v1/chat/completions", {**CHAT, "speculation": {"drafter": "nope"}}, "speculation.drafter"),
    ("/v1/chat/completions", {**CHAT, "speculation": {"draft_len": 99}}, "speculation.draft_len"),
    ("/v1/chat/completions", {**CHAT, "speculation": {"k": 3}}, "speculation.k"),
    ("/v1/chat/completions", {**CHAT, "messages": "hello"}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, -2]]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 33, "n": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "lorem ipsum " * 600}, "prompt"),
])
def test_bad_input_is_4xx_naming_the_field(base_url: str, path: str, body: dict, param: str | None) -> None:
    error = _assert_openai_error(_post(base_url, path, body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_no_op_values_of_unimplemented_fields_are_accepted(base_url: str) -> None:
    """What client libraries send by default must not be refused."""
    body = {**CHAT, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "logit_bias": {},
            "tool_choice": "none", "response_format": {"type": "text"}, "user": "u-1", "store": False,
            "verbosity": "low", "prompt_cache_key": "conversation-1", "prompt_cache_retention": "24h",
            "prompt_cache_options": {"mode": "implicit"}, "safety_identifier": "user-hash", "moderation": None,
            "messages": [{"role": "user", "content": "hi", "name": "alice"}]}
    r = _post(base_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def test_unknown_model_is_404(base_url: str) -> None:
    error = _assert_openai_error(_post(base_url, "/v1/chat/completions", {**CHAT, "model": "gpt-5"}), 404, "model")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "\xff\xfe"}', b"", b"[1, 2]", b'"text"'])
def test_malformed_bodies_are_400(base_url: str, raw: bytes) -> None:
    r = requests.post(f"{base_url}/v1/chat/completions", data=raw, timeout=30,
                      headers={**AUTH, "content-type": "application/json"})
    _assert_openai_error(r, 400)


def test_body_over_the_limit_is_413_declared_or_chunked(base_url: str) -> None:
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}).encode()
    r = requests.post(f"{base_url}/v1/chat/completions", data=body, timeout=30,
                      headers={**AUTH, "content-type": "application/json"})
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body arrives
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    r = requests.post(f"{base_url}/v1/chat/completions", data=chunks(), timeout=30,
                      headers={**AUTH, "content-type": "application/json"})
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"


# -- security ----------------------------------------------------------------------------------------
def test_inference_needs_the_api_key(base_url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, ADMIN_AUTH):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/detokenize"):
            error = _assert_openai_error(_post(base_url, path, CHAT, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        for path in ("/v1/models", "/v1/models/anything"):
            r = requests.get(f"{base_url}{path}", headers=headers, timeout=30)
            assert _assert_openai_error(r, 401)["code"] == "invalid_api_key"
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200  # probes need no key

    good = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert good.chat.completions.create(**CHAT).choices[0].message.content is not None
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_only_the_allowed_origin_may_call_from_a_browser(base_url: str) -> None:
    """CORS with `allowed_origins` set: a browser's preflight (which carries no key) is answered for
    the allowed origin and refused for another; answers, refusals included, carry the header the
    browser needs to hand them to the page."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    url = f"{base_url}/v1/chat/completions"
    ok = requests.options(url, headers={"Origin": ORIGIN, **preflight}, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = requests.options(url, headers={"Origin": "https://elsewhere.example", **preflight}, timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answered = _post(base_url, "/v1/chat/completions", body, headers={**AUTH, "Origin": ORIGIN})
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == ORIGIN
    refused = _post(base_url, "/v1/chat/completions", body, headers={"Origin": ORIGIN})
    _assert_openai_error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    stranger = _post(base_url, "/v1/chat/completions", body, headers={**AUTH, "Origin": "https://elsewhere.example"})
    assert stranger.status_code == 200 and "access-control-allow-origin" not in stranger.headers


def test_run_batch_sends_the_api_key(base_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`specroute run-batch` against a keyed server: with the key (`--api-key` or the server's
    environment variable) every line is answered; without it every line holds the 401."""
    from router.cli import main

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 2}}
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", **line}) + "\n" for i in range(2)))

    def statuses(*flags: str) -> tuple[int, list[int]]:
        # one line at a time: this app takes one request a replica and queues one more, so lines
        # sent together may meet a 429 while the last test's request is still leaving
        code = main(["run-batch", "-i", str(src), "-o", str(out), "--url", base_url, "--concurrency", "1", *flags])
        return code, [json.loads(row)["response"]["status_code"] for row in out.read_text().splitlines()]

    monkeypatch.delenv("SPECROUTE_API_KEY", raising=False)
    assert statuses() == (1, [401, 401])
    assert statuses("--api-key", API_KEY) == (0, [200, 200])
    monkeypatch.setenv("SPECROUTE_API_KEY", API_KEY)
    assert statuses() == (0, [200, 200])


def test_anthropics_messages_take_the_key_as_anthropics_clients_send_it(base_url: str) -> None:
    """`x-api-key` (an Anthropic client's api_key) or a bearer token (its auth_token); a refusal
    in Anthropic's error shape."""
    import anthropic

    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = requests.post(f"{base_url}/v1/messages", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    keyed = anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    assert keyed.messages.create(**body).usage.output_tokens >= 1
    bearer = anthropic.Anthropic(base_url=base_url, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0, timeout=60).messages.create(**body)


def test_policy_writes_and_stats_resets_need_the_admin_token(base_url: str) -> None:
    for headers in ({}, AUTH, {"Authorization": "Bearer wrong"}):
        r = requests.put(f"{base_url}/v1/policy", data=b"version: x", headers=headers, timeout=30)
        assert _assert_openai_error(r, 401)["code"] == "invalid_admin_token"
        for path in ("/v1/stats/reset", "/reset_prefix_cache"):
            r = requests.post(f"{base_url}{path}", headers=headers, timeout=30)
            assert _assert_openai_error(r, 401)["code"] == "invalid_admin_token"

    assert _post(base_url, "/v1/chat/completions", CHAT).status_code == 200
    assert _requests_recorded(base_url) >= 1
    r = requests.post(f"{base_url}/v1/stats/reset", headers=ADMIN_AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["reset"] is True, r.text
    assert _requests_recorded(base_url) == 0


def test_a_policy_cannot_point_the_service_at_a_file_outside_its_directories(base_url: str) -> None:
    policy = yaml.safe_load((REPO_ROOT / "policies" / "default_policy.yaml").read_text())
    policy["classifier"]["model"] = "/etc"
    r = requests.put(f"{base_url}/v1/policy", data=yaml.safe_dump(policy).encode(), headers=ADMIN_AUTH, timeout=60)
    error = _assert_openai_error(r, 400, "classifier.model")
    assert "outside the allowed directories" in error["message"]
    assert _post(base_url, "/v1/chat/completions", CHAT).status_code == 200


def test_secrets_never_reach_the_logs(base_url: str) -> None:
    """Ray's session logs hold every process's output: neither secret may appear in any of them."""
    import ray

    _post(base_url, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sk-guessed"})
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    leaked = [p for p in logs.rglob("*") if p.is_file() and any(
        secret.encode() in p.read_bytes() for secret in (API_KEY, ADMIN, "sk-guessed"))]
    assert not leaked, leaked


def test_no_pickle_loads_in_the_code() -> None:
    """Models, classifiers and checkpoints load from safetensors, JSON, npz (allow_pickle=False) or GGUF."""
    root = Path(__file__).resolve().parents[1]
    banned = ("pickle.load", "torch.load(", "joblib.load", "allow_pickle=True", "skops.io.load(", "dill.load")
    hits = [f"{p.relative_to(root)}: {b}" for d in ("router", "workers", "policies", "bench")
            for p in (root / d).rglob("*.py") for b in banned if b in p.read_text()]
    assert not hits, hits


# -- fuzzing the OpenAPI schema ---------------------------------------------------------------------
FUZZ_EXAMPLES = 20  # per operation and mode: a fixed budget, seeded (derandomize)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_never_get_a_5xx(base_url: str, mode: str) -> None:
    """Schema-driven requests to every operation of the live app's OpenAPI schema, valid
    (positive) and invalid (negative): any status but 5xx, and the service still serves after.
    Generation endpoints get small `max_tokens` so the budget is spent on inputs, not on decoding."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    statuses: dict[str, list[int]] = {}
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        def fuzz(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 16)
            headers = ADMIN_AUTH if case.path in ("/v1/policy", "/v1/stats/reset", "/reset_prefix_cache") else AUTH
            response = case.call(base_url=base_url, headers=headers, timeout=120)
            statuses.setdefault(case.path, []).append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error])

        try:
            fuzz()
        except Unsatisfiable:  # an operation without inputs has no invalid request to make
            assert mode == "negative", operation.path
    assert all(len(statuses.get(path, ())) >= FUZZ_EXAMPLES // 2
               for path in ("/v1/completions", "/v1/chat/completions")), statuses
    assert all(s < 500 for codes in statuses.values() for s in codes), statuses
    assert _post(base_url, "/v1/chat/completions", CHAT).status_code == 200


# -- load: a bounded queue ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_more_choices_than_capacity_is_429_streamed_or_not(base_url: str, stream: bool) -> None:
    """Three choices against one running and one queued slot: the third is refused, and so the
    request, with 429 (a refused stream's cancel raises the refusal again: not a 503)."""
    body = {"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 4, "stream": stream}
    r = _post(base_url, "/v1/completions", body)
    _assert_openai_error(r, 429)
    assert r.headers["retry-after"]
    assert _post(base_url, "/v1/completions", {**body, "n": 1}).status_code == 200


def test_beyond_capacity_is_429_with_retry_after_and_nothing_is_lost(base_url: str) -> None:
    """One request runs, one waits; the rest are refused at once with 429 + Retry-After. Every
    request admitted completes."""
    body = {"model": MODEL, "prompt": "Long:", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "speculation": {"drafter": "none"}}
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _post(base_url, "/v1/completions", body), range(8)))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 8, [r.status_code for r in responses]
    assert ok and refused, [r.status_code for r in responses]
    for r in refused:
        assert _assert_openai_error(r, 429)["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 200
    assert _post(base_url, "/v1/completions", {**body, "max_tokens": 4}).status_code == 200


def test_background_responses_wait_for_room_and_past_their_bound_are_429(base_url: str) -> None:
    """One request runs and one waits in a worker replica: of background responses sent together
    the next meets a full queue. It stays `queued` and is tried again after Retry-After (never
    `failed` as a 429), so every one completes as a synchronous request does; one more than the
    ingress holds is refused with 429 naming `background`."""
    body = {"model": MODEL, "input": "Long:", "max_output_tokens": 200, "temperature": 0, "ignore_eos": True,
            "speculation": {"drafter": "none"}}
    ids = []
    for _ in range(BACKGROUND_HELD):
        r = _post(base_url, "/v1/responses", {**body, "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        ids.append(r.json()["id"])
    refused = _post(base_url, "/v1/responses", {**body, "background": True})
    assert _assert_openai_error(refused, 429, "background")["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    held = requests.get(f"{base_url}/v1/stats", timeout=30).json()["background_responses"]
    assert 0 < held["num_held"] <= held["max_held"] == BACKGROUND_HELD, held  # the first may be done by now

    def read(response_id: str) -> dict:
        return requests.get(f"{base_url}/v1/responses/{response_id}", headers=AUTH, timeout=30).json()

    wait_for(lambda: all(read(i)["status"] not in ("queued", "in_progress") for i in ids),
             "the background responses", 120, every_s=0.2)
    sync = _post(base_url, "/v1/responses", {**body, "store": False}).json()
    for response_id in ids:
        done = read(response_id)
        assert done["status"] == sync["status"] == "incomplete", done
        assert done["output"][0]["content"][0]["text"] == sync["output"][0]["content"][0]["text"]
    again = _post(base_url, "/v1/responses", {**body, "background": True, "max_output_tokens": 4})  # room again
    assert again.status_code == 200, again.text
    wait_for(lambda: read(again.json()["id"])["status"] == "incomplete", "the last background response", 60)
    fams = {f.name: f.samples for f in text_string_to_metric_families(
        requests.get(f"{base_url}/metrics", timeout=30).text)}
    assert (fams["specroute_background_responses"][0].value, fams["specroute_background_responses_limit"][0].value) \
        == (0, BACKGROUND_HELD)


def test_a_background_response_ended_elsewhere_stops_and_one_whose_ingress_is_gone_fails(
        base_url: str, redis_server: ThrowawayRedis) -> None:
    """Another ingress replica (a store on the same Redis) cancels a background response this one
    generates: it stays `cancelled` and this one stops its request at its next lease renewal. A
    running response whose lease lapsed (its ingress gone) reads `failed`; one whose lease holds
    stays running, and a cancel marks it cancelled."""
    import asyncio

    from router.response_store import RedisResponseStore, StoredResponse

    def other() -> RedisResponseStore:  # an async client lives in one event loop: a store per asyncio.run
        return RedisResponseStore(redis_server.url, 1000, prefix="reliability")

    def stored(response_id: str) -> StoredResponse:
        return asyncio.run(other().get(response_id))

    def read(response_id: str) -> dict:
        return requests.get(f"{base_url}/v1/responses/{response_id}", headers=AUTH, timeout=30).json()

    aborted = num_finished(base_url, "abort")
    body = {"model": MODEL, "input": "Long:", "max_output_tokens": 960, "temperature": 0, "ignore_eos": True,
            "speculation": {"drafter": "none"}, "background": True}
    response_id = _post(base_url, "/v1/responses", body).json()["id"]
    wait_for(lambda: stored(response_id).status == "in_progress", "the background response to start", 30, every_s=0.05)
    first = stored(response_id).lease_until
    assert time.time() < first <= time.time() + BACKGROUND_LEASE_S, first
    wait_for(lambda: stored(response_id).lease_until > first, "its lease renewed", 10, every_s=0.05)
    running = stored(response_id)
    cancelled = StoredResponse({**running.response, "status": "cancelled"}, running.conversation)
    assert asyncio.run(other().put(response_id, cancelled, if_status=RUNNING)), "it had finished: make it longer"
    wait_for(lambda: _observe(base_url)["background_responses"]["num_held"] == 0, "the ingress to stop it", 30)
    wait_for(lambda: num_finished(base_url, "abort") == aborted + 1, "the worker to abort its request", 30)
    assert read(response_id)["status"] == "cancelled" and stored(response_id) == cancelled  # not overwritten

    now = time.time()
    for name, lease_until in (("resp_gone", now - 1), ("resp_alive", now + 600)):
        asyncio.run(other().put(name, StoredResponse({"id": name, "object": "response", "status": "in_progress"}, [],
                                                   lease_until)))
    gone = read("resp_gone")
    assert gone["status"] == "failed" and gone["error"]["code"] == "server_error", gone
    assert stored("resp_gone").lease_until is None
    r = _post(base_url, "/v1/responses/resp_gone/cancel", {})
    assert r.status_code == 400 and "failed" in r.json()["error"]["message"], r.text
    assert read("resp_alive")["status"] == "in_progress"
    r = _post(base_url, "/v1/responses/resp_alive/cancel", {})
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text


def test_queue_time_counts_the_wait_for_a_replica(base_url: str) -> None:
    """With one request slot a replica, a second request waits in Serve's queue while the first
    runs: vLLM's request_queue_time_seconds counts that wait (from the ingress's receipt to the
    batch), not only the batch's own queue."""
    count, total = _queue_time(base_url)
    body = {"model": MODEL, "prompt": "Long:", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "speculation": {"drafter": "none"}}
    second: list[requests.Response] = []
    with requests.post(f"{base_url}/v1/completions", json={**body, "stream": True}, headers=AUTH, stream=True,
                       timeout=60) as first:
        lines = first.iter_lines()
        next(line for line in lines if line)  # the first request runs
        started = time.monotonic()
        waiter = threading.Thread(target=lambda: second.append(
            _post(base_url, "/v1/completions", {**body, "max_tokens": 4})))
        waiter.start()
        for _ in lines:
            pass
        rest_s = time.monotonic() - started
    waiter.join(60)
    assert first.status_code == 200 and second[0].status_code == 200
    after_count, after_total = _queue_time(base_url)
    assert after_count == count + 2
    assert after_total - total >= 0.5 * rest_s  # the second waited out most of the first


def _queue_time(base_url: str) -> tuple[float, float]:
    """request_queue_time_seconds' count and sum."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", timeout=30).text
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == "specroute_request_queue_time_seconds")
    samples = {s.name: s.value for s in family.samples}
    return samples["specroute_request_queue_time_seconds_count"], samples["specroute_request_queue_time_seconds_sum"]


# -- soak: steady memory ----------------------------------------------------------------------------
def test_memory_is_steady_over_many_requests(base_url: str) -> None:
    """A bounded soak for CI (tests/test_soak.py runs the long one): after a warm-up, 120 more
    requests (streamed, cancelled, plain and speculative) leave the worker's memory where it was."""
    _run_mixed_requests(base_url, 30)
    warm = _worker_status()["rss_bytes"]
    _run_mixed_requests(base_url, 120)
    wait_for(lambda: _worker_status()["num_active"] == 0, "the last cancel, which lands between steps", 30)
    status = _worker_status()
    assert status["num_pending"] == 0 and status["num_cancelled"] >= 30, status
    assert status["rss_bytes"] - warm < 48 * 2**20, (warm, status["rss_bytes"])


def _run_mixed_requests(base_url: str, n: int) -> None:
    for i in range(n):
        drafter = ("auto", "none", "ngram", "self")[i % 4]
        body = {**CHAT, "max_tokens": 12, "speculation": {"drafter": drafter}}
        if i % 5 == 4:  # a client that goes away after the first event
            with _post(base_url, "/v1/chat/completions", {**body, "stream": True, "max_tokens": 200,
                                                            "ignore_eos": True}, stream=True) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        else:
            assert _post(base_url, "/v1/chat/completions", body).status_code == 200


# -- faults ------------------------------------------------------------------------------------------
def test_redis_stopped_mid_load_and_restarted(base_url: str, redis_server: ThrowawayRedis) -> None:
    """Requests keep succeeding while Redis is down (the worker records locally); once Redis is
    back the buffered records are flushed and the shared counters equal the requests served."""
    requests.post(f"{base_url}/v1/stats/reset", headers=ADMIN_AUTH, timeout=30).raise_for_status()
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            statuses.append(_post(base_url, "/v1/chat/completions", CHAT).status_code)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        wait_for(lambda: len(statuses) >= 3, "requests before the stop", 120)
        redis_server.stop("save")  # a restart, not a wipe: the data comes back with it
        n_at_stop = len(statuses)
        wait_for(lambda: len(statuses) >= n_at_stop + 4, "requests served with Redis down", 120)
        redis_server.start()
        n_at_restart = len(statuses)
        wait_for(lambda: len(statuses) >= n_at_restart + 3, "requests after the restart (their flushes carry the backlog)", 120)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert statuses and all(s == 200 for s in statuses), statuses
    _post(base_url, "/v1/chat/completions", CHAT).raise_for_status()  # one more flush after the last
    wait_for(lambda: _requests_recorded(base_url) == len(statuses) + 1, "the counters to reconcile", 30)
    health = _observe(base_url)["store"]
    assert health["connected"] and health["num_errors"] > 0, health  # the outage was seen, and survived


RESPONSE = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}


def test_stored_responses_are_shared_through_redis(base_url: str, redis_server: ThrowawayRedis) -> None:
    """Another ingress replica (a store on the same Redis and prefix) reads what this one stored,
    and this one continues what the other stored."""
    import asyncio

    from router.response_store import RedisResponseStore, StoredResponse

    first = _post(base_url, "/v1/responses", {**RESPONSE, "input": "Count: one two three"}).json()
    conversation = [{"role": "user", "content": "Count: one two three"},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "four"}]}]

    async def other_ingress() -> StoredResponse | None:
        other = RedisResponseStore(redis_server.url, 1000, prefix="reliability")
        await other.put("resp_elsewhere", StoredResponse({"id": "resp_elsewhere"}, conversation))
        return await other.get(first["id"])

    assert asyncio.run(other_ingress()).response == first
    follow = _post(base_url, "/v1/responses", {**RESPONSE, "input": "Again", "previous_response_id": "resp_elsewhere"})
    whole = _post(base_url, "/v1/responses", {**RESPONSE, "store": False,
                                              "input": [*conversation, {"role": "user", "content": "Again"}]})
    assert follow.status_code == 200, follow.text
    assert _text_and_usage(follow.json()) == _text_and_usage(whole.json()), (follow.text, whole.text)


def _text_and_usage(response: dict) -> tuple[str, int]:
    return response["output"][0]["content"][0]["text"], response["usage"]["input_tokens"]


def test_stored_responses_while_redis_is_down(base_url: str, redis_server: ThrowawayRedis) -> None:
    """Responses are answered and stored in the ingress while Redis is down, and continue there; one
    stored before the outage is a 503 with Retry-After (it may exist). Once Redis is back, that one is
    readable again and the ingress moves what it held to Redis."""
    import asyncio

    from router.response_store import RedisResponseStore, StoredResponse

    before = _post(base_url, "/v1/responses", {**RESPONSE, "input": "Before"}).json()["id"]
    redis_server.stop("save")
    try:
        during = _post(base_url, "/v1/responses", {**RESPONSE, "input": "During"})
        assert during.status_code == 200, during.text
        follow = _post(base_url, "/v1/responses", {**RESPONSE, "input": "More",
                                                    "previous_response_id": during.json()["id"]})
        assert follow.status_code == 200, follow.text
        r = requests.get(f"{base_url}/v1/responses/{before}", headers=AUTH, timeout=30)
        assert _assert_openai_error(r, 503)["code"] == "service_unavailable" and r.headers["retry-after"]
        r = _post(base_url, "/v1/responses", {**RESPONSE, "input": "x", "previous_response_id": before})
        assert _assert_openai_error(r, 503, "previous_response_id")
        health = _observe(base_url)["response_store"]
        assert not health["connected"] and health["num_errors"] > 0 and health["num_local"] == 2, health
    finally:
        redis_server.start()
    wait_for(lambda: requests.get(f"{base_url}/v1/responses/{before}", headers=AUTH, timeout=30).status_code == 200,
             "the stored response to be readable again", 30, every_s=0.5)
    r = requests.get(f"{base_url}/v1/responses/{during.json()['id']}", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    fams = {f.name: f.samples for f in text_string_to_metric_families(
        requests.get(f"{base_url}/metrics", timeout=30).text)}
    assert [(s.labels, s.value) for s in fams["specroute_response_store_connected"]] == [({"backend": "redis"}, 1)]
    assert fams["specroute_response_store_errors"][0].value > 0 and fams["specroute_response_store_local"][0].value == 0

    async def other_ingress() -> StoredResponse | None:  # the ingress moved what it held to Redis
        return await RedisResponseStore(redis_server.url, 1000, prefix="reliability").get(follow.json()["id"])

    assert asyncio.run(other_ingress()).response == follow.json()


def test_killed_replica_ends_in_flight_cleanly_and_new_requests_succeed(base_url: str) -> None:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "TargetWorker" in a["name"]]
    assert len(names) == 1, names
    replica = ray.get_actor(names[0], namespace="serve")
    body = {"model": MODEL, "prompt": "Long:", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True, "speculation": {"drafter": "none"}}
    with _post(base_url, "/v1/completions", body, stream=True) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        ray.kill(replica, no_restart=False)
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert "error" in events[-1], events[-1]  # the stream ends with an error event, not a silent cut
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)

    deadline = time.monotonic() + 180
    while True:  # while Serve restarts the replica: clean 503 (or 429 while requests wait for it)
        r = _post(base_url, "/v1/chat/completions", CHAT)
        if r.status_code == 200:
            break
        _assert_openai_error(r, r.status_code)
        assert r.status_code in (503, 429), r.text
        assert time.monotonic() < deadline, "the replica did not come back"
        time.sleep(1)
    assert all(_post(base_url, "/v1/chat/completions", CHAT).status_code == 200 for _ in range(3))


# -- helpers -----------------------------------------------------------------------------------------
def _observe(base_url: str) -> dict:
    r = requests.get(f"{base_url}/v1/stats", timeout=30)
    r.raise_for_status()
    return r.json()


def _requests_recorded(base_url: str) -> int:
    """Requests counted in the shared store's all-time statistics (one decision each)."""
    domains = _observe(base_url)["domains"].values()
    return sum(d["count"] for domain in domains for d in domain["decisions"]["all_time"])
