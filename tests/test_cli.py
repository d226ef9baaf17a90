"""`specroute generate` as a user runs it: a subprocess on the real target; and what `specroute
serve` refuses before Ray starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import THINKING_TEMPLATE

from workers.config import load_engine_config

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
JSON_KEYS = {"text", "token_ids", "domain", "drafter", "num_steps", "num_draft_tokens",
             "num_accepted_tokens", "mean_acceptance_length", "wall_s"}


def specroute(*args: str, entry_point: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "specroute"
    cmd = [str(script)] if entry_point else [sys.executable, "-m", "router.cli"]
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def generate_json(*args: str, **kw) -> dict:
    proc = specroute("generate", "--prompt", PROMPT, "--json", "--max-tokens", "8", *args, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)  # stdout is exactly one JSON object


@pytest.fixture(scope="module")
def plain_json() -> dict:
    return generate_json("--drafter", "none", entry_point=True)


def test_generate_json_has_the_documented_fields(plain_json: dict) -> None:
    out = plain_json
    assert JSON_KEYS <= set(out)
    assert isinstance(out["text"], str) and out["text"]
    assert isinstance(out["token_ids"], list) and all(isinstance(t, int) for t in out["token_ids"])
    assert 1 <= len(out["token_ids"]) <= 8
    assert out["drafter"] == "none"
    assert out["num_draft_tokens"] == 0 and out["num_accepted_tokens"] == 0
    assert out["num_steps"] == len(out["token_ids"])  # plain: one token per target forward
    assert out["mean_acceptance_length"] == pytest.approx(1.0)
    assert isinstance(out["wall_s"], (int, float)) and out["wall_s"] > 0


def test_generate_prints_the_text_as_it_is_generated(plain_json: dict) -> None:
    """Text mode prints the output as --json reports it, a stop string cut (held back while it may
    still be one), and a newline; stderr carries no progress bar of the model's load."""
    text = plain_json["text"]
    stop = text.strip()[4:7]
    proc = specroute("generate", "--prompt", PROMPT, "--max-tokens", "8", "--drafter", "ngram", "--stop", stop)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == text[: text.find(stop)] + "\n"
    assert "Loading weights" not in proc.stderr  # no progress bar for a load of the converted model


def test_generate_ngram_gives_the_same_tokens_as_plain(plain_json: dict) -> None:
    out = generate_json("--drafter", "ngram", "--logprobs", "2")
    assert out["drafter"] == "ngram"
    assert out["token_ids"] == plain_json["token_ids"]
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]  # greedy: each its row's likeliest
    assert all(e["top_logprobs"][0] == {k: e[k] for k in ("token", "token_id", "logprob")} for e in out["logprobs"])
    assert "logprobs" not in plain_json
    assert out["text"] == plain_json["text"]
    assert 0 <= out["num_accepted_tokens"] <= out["num_draft_tokens"]
    assert out["num_steps"] <= len(out["token_ids"])


def test_generate_takes_vllms_sampling_options(plain_json: dict) -> None:
    word = plain_json["text"].split()[0]
    out = generate_json("--drafter", "ngram", "--bad-word", word, "--ignore-eos", "--min-tokens", "8", "--min-p", "0.05")
    assert len(out["token_ids"]) == 8 and out["token_ids"] != plain_json["token_ids"]
    assert word not in out["text"].split()
    first = plain_json["token_ids"][0]
    assert generate_json("--stop-token-id", str(first))["token_ids"] == [first]  # a stop token is kept, as EOS is


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lowered = proc.stderr.lower()
    for needle in needles:
        assert needle.lower() in lowered, (needle, proc.stderr[-2000:])
    assert proc.stdout.strip() == ""


@pytest.mark.parametrize("value", ["0", "-4", "many"])
def test_bad_max_tokens_is_refused(value: str) -> None:
    proc = specroute("generate", "--prompt", PROMPT, f"--max-tokens={value}")
    assert_user_error(proc, "max-tokens", value)


@pytest.mark.parametrize(("args", "needles"), [
    (["--draft-len", "0"], ["draft-len", "0"]),
    (["--draft-len", "99", "--drafter", "ngram"], ["draft_len", "99"]),
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--top-k", "-5"], ["top_k", "-5"]),
    (["--stop", "x" * 300], ["stop", "256"]),
    (["--logprobs", "21"], ["logprobs", "21"]),
    (["--presence-penalty", "3"], ["presence_penalty", "3"]),
    (["--min-p", "2"], ["min_p", "2"]),
    (["--allowed-token-id", "999999"], ["allowed_token_ids", "999999"]),
    (["--policy", "/nonexistent/policy.yaml"], ["/nonexistent/policy.yaml"]),
])
def test_bad_generate_arguments_are_refused(args: list[str], needles: list[str]) -> None:
    proc = specroute("generate", "--prompt", PROMPT, "--max-tokens", "4", *args)
    assert_user_error(proc, *needles)


@pytest.mark.parametrize(("args", "needles"), [
    (["--prompt", " "], ["prompt", "empty"]),
    (["--drafter", "no-such-drafter"], ["no-such-drafter", "ngram"]),
    (["--draft-len", "99"], ["draft_len", "99"]),
    (["--top-p", "1.5"], ["top_p", "1.5"]),
    (["--response-format", '{"type": "json_schema"}'], ["--response-format", "json_schema"]),
    (["--policy", "POLICY"], ["domains.chat.k_max", "99"]),
])
def test_what_the_flags_and_files_decide_is_refused_before_the_model_loads(
    tmp_path: Path, args: list[str], needles: list[str],
) -> None:
    """A target that cannot load: the error is the flag's, so the flags were checked first."""
    config = tmp_path / "engine.yaml"
    config.write_text(f"target:\n  model: {tmp_path / 'no-such-model'}\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\ndefault_domain: chat\ndomains: {chat: {drafters: [ngram], k_max: 99}}\n")
    args = [str(policy) if a == "POLICY" else a for a in args]
    proc = specroute("generate", "--prompt", PROMPT, "--config", str(config), *args)
    assert_user_error(proc, *needles)
    assert "no-such-model" not in proc.stderr


def test_a_config_that_is_not_yaml_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_bytes(b"target: [unclosed\n\xff")
    proc = specroute("generate", "--prompt", PROMPT, "--config", str(config))
    assert_user_error(proc, str(config))


def test_prompt_beyond_the_context_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("target:\n  max_model_len: 64\n")
    long_prompt = "Please summarise the following text. " + "The cat sat on the mat. " * 20
    proc = specroute("generate", "--prompt", long_prompt, "--max-tokens", "8", "--config", str(config))
    assert_user_error(proc, "64", "context")


def test_invalid_config_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("target:\n  max_model_len: -5\n")
    proc = specroute("generate", "--prompt", PROMPT, "--config", str(config))
    assert_user_error(proc, "max_model_len", str(config))
    proc = specroute("generate", "--prompt", PROMPT, "--config", str(tmp_path / "missing.yaml"))
    assert_user_error(proc, "missing.yaml")


def test_generate_drafts_from_a_prediction(plain_json: dict) -> None:
    out = generate_json("--drafter", "prediction", "--prediction", plain_json["text"])
    assert out["token_ids"] == plain_json["token_ids"] and out["drafters_used"] == ["prediction"]
    assert out["prediction_tokens"]["accepted"] == out["num_accepted_tokens"] > 0
    assert "prediction_tokens" not in plain_json


def test_generate_holds_the_output_to_a_response_format() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}}}
    out = generate_json("--response-format", json.dumps(fmt), "--max-tokens", "24")
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"answer"}
    proc = specroute("generate", "--prompt", PROMPT, "--response-format", '{"type": "json_schema"}')
    assert_user_error(proc, "--response-format", "json_schema")


def test_generate_splits_a_reasoning_models_thinking(tmp_path: Path) -> None:
    """Under a reasoning parser `--json` gives the thinking and the answer apart: a template that
    opens the thinking in the prompt makes all of an unclosed output thinking."""
    (tmp_path / "thinking.jinja").write_text(THINKING_TEMPLATE)
    config = yaml.safe_load((REPO / "deploy" / "serve.cpu.yaml").read_text())
    engine = config["applications"][0]["args"]["engine"]
    engine["target"].update(chat_template=str(tmp_path / "thinking.jinja"), reasoning_parser="deepseek_r1")
    engine["drafters"] = [{"kind": "ngram"}]
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    out = generate_json("--config", str(tmp_path / "serve.yaml"))
    assert out["reasoning"] == out["text"].strip() and out["content"] == ""
    assert out["num_reasoning_tokens"] == len(out["token_ids"]) == 8
    assert "reasoning" not in generate_json("--config", str(tmp_path / "serve.yaml"), "--raw")


def test_generate_auto_routes_and_reports_the_decision(plain_json: dict) -> None:
    out = generate_json()  # --drafter auto is the default
    assert out["token_ids"] == plain_json["token_ids"]  # routing never changes greedy output
    assert out["domain"] in ("chat", "code", "math", "rag", "summarization", "translation")
    assert out["policy_version"] == "default-7" and out["reason"] in ("best", "explore", "fallback")
    assert sum(steps for _, _, steps in out["schedule"]) == out["num_steps"]
    configured = {d.name for d in load_engine_config(REPO / "deploy" / "serve.cpu.yaml").drafters}
    assert {drafter for drafter, _, _ in out["schedule"]} <= configured | {"none"}


def test_generate_takes_the_serve_configs_routing(tmp_path: Path) -> None:
    """A Serve config's `routing` args reach generate as they reach the service: its policy (here
    the shipped one under another version) unless --policy names one; a bad field is refused,
    named, before the model loads."""
    policy = yaml.safe_load((REPO / "policies" / "default_policy.yaml").read_text())
    policy["version"] = "from-serve-config"
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    serve = yaml.safe_load((REPO / "deploy" / "serve.cpu.yaml").read_text())
    serve["applications"][0]["args"]["routing"]["policy"] = str(tmp_path / "policy.yaml")
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve))
    assert generate_json("--config", str(tmp_path / "serve.yaml"))["policy_version"] == "from-serve-config"
    serve["applications"][0]["args"]["routing"]["seed"] = "x"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(serve))
    proc = specroute("generate", "--prompt", PROMPT, "--config", str(tmp_path / "bad.yaml"))
    assert_user_error(proc, "routing.seed", "bad.yaml")


def test_generate_with_a_bad_policy_file(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("version: 1\ndefault_domain: chat\ndomains: {chat: {drafters: [ngram], k_max: 99}}\n")
    proc = specroute("generate", "--prompt", PROMPT, "--policy", str(bad))
    assert_user_error(proc, "domains.chat.k_max", "99")
    proc = specroute("generate", "--prompt", PROMPT, "--policy", str(tmp_path / "missing.yaml"))
    assert_user_error(proc, "--policy", "missing.yaml")


@pytest.mark.parametrize(("app", "needles"), [
    ({"import_path": "router.app:build"}, ["import_path", "router.app:build", "router.app:build_app"]),
    ({"import_path": "nowhere.app:build_app"}, ["import_path", "nowhere"]),
    ({"import_path": "router.app:build_app", "args": {"engine": {"target": {"max_model_len": -5}}}},
     ["engine.target.max_model_len", "-5"]),
    ({"import_path": "router.app:build_app", "args": {"engine": {"drafters": [{"kind": "ngram", "typo": 1}]}}},
     ["typo"]),
])
def test_serve_refuses_a_bad_application_naming_the_field(tmp_path: Path, app: dict, needles: list[str]) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "specroute", "route_prefix": "/", **app}]}))
    proc = specroute("serve", "--config", str(config), "--port", "8765", timeout=60)
    assert proc.returncode == 2
    assert_user_error(proc, *needles)


def test_serve_flags_set_the_applications_args_over_the_config() -> None:
    from router.app import AppArgs
    from router.cli import build_parser, serve_overrides
    from router.serve import load_serve_config, with_overrides

    config = load_serve_config(REPO / "deploy" / "serve.gpu.yaml")  # autoscaling
    flags = build_parser().parse_args(["serve", "--config", "x.yaml", "--served-model-name", "a", "b", "--api-key",
                                       "k", "--max-model-len", "512", "--tool-call-parser", "hermes", "--num-replicas",
                                       "2", "--max-num-seqs", "3"])
    args = AppArgs.model_validate(with_overrides(config, serve_overrides(flags))["applications"][0]["args"])
    assert (args.served_model_name, args.api_key, args.num_replicas, args.autoscaling_config) == (["a", "b"], "k", 2,
                                                                                                  None)
    assert (args.engine.target.max_model_len, args.engine.target.tool_call_parser) == (512, "hermes")
    assert args.engine.scheduler.max_num_seqs == 3
    gpu = AppArgs.model_validate(config["applications"][0]["args"])  # the config itself unchanged
    assert gpu.engine.target.model == args.engine.target.model and gpu.autoscaling_config is not None
    bare = with_overrides({"applications": [{"import_path": "router.app:build_app"}]},
                          serve_overrides(build_parser().parse_args(["serve", "--max-model-len", "64"])))
    assert bare["applications"][0]["args"] == {"engine": {"target": {"max_model_len": 64}}}


def test_serve_names_the_flag_whose_value_the_application_refuses() -> None:
    proc = specroute("serve", "--served-model-name", "a", "a", "--port", "8765", timeout=60)
    assert proc.returncode == 2
    assert_user_error(proc, "served_model_name", "--served-model-name")
