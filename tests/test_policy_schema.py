"""The YAML policy schema, its loader, the drafter check, and `specroute policy check`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.records import PLAIN
from policies.schema import (
    DEFAULT_POLICY_PATH,
    DomainPolicy,
    Policy,
    PolicyError,
    check_policy_drafters,
    load_policy,
)
from router.cli import DEFAULT_SERVE_CONFIG, main
from workers.config import load_engine_config

DEFAULT_DOMAINS = {"code", "math", "summarization", "rag", "translation", "chat"}

VALID: dict[str, Any] = {
    "version": "t1",
    "default_domain": "chat",
    "domains": {
        "chat": {"drafters": ["ngram", PLAIN], "k_min": 2, "k_max": 6, "priors": {"ngram": 0.5}},
        "code": {"drafters": ["ngram"]},
    },
    "classifier": {"rules": [{"domain": "code", "regex": "```"}]},
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    """VALID with the dotted `path` set to `value` (or removed when value is DELETE)."""
    data = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node: Any = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


DELETE = object()


def test_shipped_default_policy_validates() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    assert set(policy.domains) == DEFAULT_DOMAINS
    assert policy.default_domain in policy.domains
    shipped = {d.name for d in load_engine_config(DEFAULT_SERVE_CONFIG).drafters}
    for name, dp in policy.domains.items():
        assert {"ngram", "suffix", PLAIN} <= set(dp.drafters) <= shipped | {PLAIN}, name
        assert all(0.0 <= p <= 1.0 for p in dp.priors.values()) and set(dp.priors) == set(dp.drafters) - {PLAIN}
        assert dp.k_max == 10
        # every domain asks its cheap drafters first: in the copy domains prompt lookup and suffix
        # in turn, where the trained drafters draft (chat, code, math) before them
        assert dp.cheap_first
    # copying tasks accept more than open chat
    assert policy.domains["translation"].priors["ngram"] > policy.domains["chat"].priors["ngram"]
    assert check_policy_drafters(policy, shipped).ignored == ()
    assert check_policy_drafters(policy, {"ngram"}).policy.domains["chat"].drafters == ["ngram", PLAIN]


def test_default_policy_rules_route_as_documented() -> None:
    rules = load_policy(DEFAULT_POLICY_PATH).classifier.rules

    def route(prompt: str) -> str | None:
        for rule in rules:
            if rule.pattern is not None and rule.pattern.search(prompt):
                return rule.domain
            if rule.keywords and any(k.lower() in prompt.lower() for k in rule.keywords):
                return rule.domain
        return None

    assert route("```python\nprint(1)\n```") == "code"
    assert route("def add(a, b):\n    return a + b") == "code"
    assert route("Please summarize this article.") == "summarization"
    assert route("TL;DR of the thread?") == "summarization"
    assert route("Translate to German: good morning") == "translation"
    assert route("How are you today?") is None


def test_defaults_live_in_the_models() -> None:
    policy = load_policy({"version": "v", "default_domain": "a", "domains": {"a": {"drafters": [PLAIN]}}})
    dp = policy.domains["a"]
    assert (dp.fallback_threshold, dp.hysteresis) == (1.0, 0.05)
    assert dp.k_min >= 1 and dp.k_max >= dp.k_min
    assert policy.exploration.method == "ucb"
    assert policy.classifier.model is None and policy.classifier.rules == []
    assert policy.window.seconds > 0


def test_load_policy_accepts_text_path_and_str_path(tmp_path: Path) -> None:
    text = yaml.safe_dump(VALID)
    file = tmp_path / "p.yaml"
    file.write_text(text)
    assert load_policy(text) == load_policy(file) == load_policy(str(file)) == Policy.model_validate(VALID)
    assert load_policy({**VALID, "version": 2}).version == "2"  # YAML `version: 2`


def test_policy_is_frozen() -> None:
    policy = load_policy(VALID)
    with pytest.raises(ValueError):
        policy.version = "other"  # type: ignore[misc]


INVALID = [
    # (case id, data, substrings the one-line message must contain)
    ("missing version", with_change("version", DELETE), ["version", "missing"]),
    ("empty version", with_change("version", ""), ["version"]),
    ("k_max below k_min", with_change("domains.chat.k_max", 1), ["domains.chat.k_max", "1", "k_min 2"]),
    ("k_max above 16", with_change("domains.chat.k_max", 17), ["domains.chat.k_max", "17"]),
    ("k_min zero", with_change("domains.chat.k_min", 0), ["domains.chat.k_min", "0"]),
    ("prior above 1", with_change("domains.chat.priors", {"ngram": 1.5}), ["domains.chat.priors.ngram", "1.5"]),
    ("prior below 0", with_change("domains.chat.priors", {"ngram": -0.1}), ["domains.chat.priors.ngram", "-0.1"]),
    ("prior for unlisted drafter", with_change("domains.code.priors", {"eagle": 0.5}),
     ["domains.code.priors.eagle", "'eagle'"]),
    ("prior for plain", with_change("domains.chat.priors", {PLAIN: 0.5}), [f"domains.chat.priors.{PLAIN}"]),
    ("unknown default_domain", with_change("default_domain", "poetry"), ["default_domain", "'poetry'"]),
    ("no domains", with_change("domains", {}), ["domains"]),
    ("uppercase domain name", with_change("domains.Code", {"drafters": ["ngram"]}), ["domains.Code", "'Code'"]),
    ("rule for unknown domain", with_change("classifier.rules.0.domain", "poetry"),
     ["classifier.rules.0.domain", "'poetry'"]),
    ("bad regex", with_change("classifier.rules.0.regex", "(unclosed"), ["classifier.rules.0.regex", "'(unclosed'"]),
    ("regex and keywords", with_change("classifier.rules.0.keywords", ["def"]), ["classifier.rules.0.regex", "both"]),
    ("neither regex nor keywords", with_change("classifier.rules.0.regex", DELETE), ["classifier.rules.0", "neither"]),
    ("empty keywords", with_change("classifier.rules", [{"domain": "code", "keywords": []}]),
     ["classifier.rules.0.keywords", "[]"]),
    ("empty drafters", with_change("domains.code.drafters", []), ["domains.code.drafters"]),
    ("duplicate drafters", with_change("domains.code.drafters", ["ngram", "ngram"]),
     ["domains.code.drafters", "'ngram'"]),
    ("unknown top-level key", with_change("routing", "fast"), ["routing", "fast"]),
    ("unknown domain key", with_change("domains.code.k", 3), ["domains.code.k"]),
    ("wrong type", with_change("domains.code.k_min", "many"), ["domains.code.k_min", "'many'"]),
    ("drafters not a list", with_change("domains.code.drafters", "ngram"), ["domains.code.drafters", "'ngram'"]),
    ("min_confidence above 1", with_change("classifier.min_confidence", 2), ["classifier.min_confidence", "2"]),
    ("unknown exploration method", with_change("exploration", {"method": "greedy"}),
     ["exploration.method", "'greedy'"]),
    ("probe_every_steps zero", with_change("exploration", {"probe_every_steps": 0}),
     ["exploration.probe_every_steps", "0"]),
    ("negative ucb_c", with_change("exploration", {"ucb_c": -1}), ["exploration.ucb_c", "-1"]),
    ("window seconds zero", with_change("window", {"seconds": 0}), ["window.seconds", "0"]),
    ("fallback_threshold zero", with_change("domains.code.fallback_threshold", 0),
     ["domains.code.fallback_threshold", "0"]),
    ("negative hysteresis", with_change("domains.code.hysteresis", -0.1), ["domains.code.hysteresis", "-0.1"]),
    ("nan prior", with_change("domains.chat.priors", {"ngram": float("nan")}), ["domains.chat.priors.ngram"]),
]


@pytest.mark.parametrize(("data", "expected"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_policy_is_refused_naming_the_field(data: dict[str, Any], expected: list[str]) -> None:
    assert Policy.model_fields  # the schema exists (guards against an empty parametrization)
    with pytest.raises(PolicyError) as info:
        load_policy(yaml.safe_dump(data))
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_the_valid_base_case_is_valid() -> None:
    # the invalid table derives from VALID: each case fails only because of its own change
    assert load_policy(VALID).domains["chat"] == DomainPolicy(
        drafters=["ngram", PLAIN], k_min=2, k_max=6, priors={"ngram": 0.5})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("- a\n- b\n", "list"), ("just text", "str"), ("", "NoneType"), ("a: [1\n", "not valid YAML")],
    ids=["list", "scalar", "empty", "bad yaml"],
)
def test_yaml_that_is_not_a_mapping_is_refused(text: str, expected: str) -> None:
    with pytest.raises(PolicyError, match=expected):
        load_policy(text)


def test_unreadable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy"):
        load_policy(tmp_path / "missing.yaml")


def test_check_policy_drafters() -> None:
    policy = load_policy(with_change("domains.code.drafters", ["ngram", "eagle"]))
    usable = check_policy_drafters(policy, {"ngram", "eagle"})  # all configured: as it is
    assert usable.policy == policy and usable.ignored == ()
    # a drafter the engine lacks is ignored, named; the domain keeps what the engine has
    data = with_change("domains.code.drafters", ["ngram", "eagle"])
    data["domains"]["code"]["priors"] = {"ngram": 0.5, "eagle": 0.8}
    usable = check_policy_drafters(load_policy(data), {"ngram"})
    assert usable.policy.domains["code"].drafters == ["ngram"] and usable.policy.domains["code"].priors == {"ngram": 0.5}
    assert len(usable.ignored) == 1 and usable.ignored[0].startswith("domains.code.drafters: 'eagle'")
    assert usable.policy.domains["chat"] == policy.domains["chat"]
    # a drafter several domains name: one line naming each field
    data["domains"]["chat"]["drafters"] = [*policy.domains["chat"].drafters, "eagle"]
    [line] = check_policy_drafters(load_policy(data), {"ngram", *policy.domains["chat"].drafters}).ignored
    assert line.startswith("domains.chat.drafters, domains.code.drafters: 'eagle' is not configured")  # policy order
    # a domain left with nothing to run is refused, naming it
    with pytest.raises(PolicyError) as info:
        check_policy_drafters(load_policy(with_change("domains.code.drafters", ["eagle"])), {"ngram"})
    assert str(info.value).startswith("domains.code.drafters: none of ['eagle']")
    # plain decoding is always available
    plain_only = {"version": "v", "default_domain": "a", "domains": {"a": {"drafters": [PLAIN]}}}
    assert check_policy_drafters(load_policy(plain_only), set()).ignored == ()


def test_cli_policy_check_ok_on_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(DEFAULT_POLICY_PATH)]) == 0
    out, err = capsys.readouterr()
    version = load_policy(DEFAULT_POLICY_PATH).version
    assert out.strip() == f"ok: policy {version}, 6 domains"
    assert err == ""


def test_cli_policy_check_refuses_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_change("domains.chat.k_max", 1)))
    assert main(["policy", "check", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "domains.chat.k_max: 1 is below k_min 2" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_policy_check_drafters_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # an engine without ngram still runs every domain (plain): ok, each ignored drafter named
    assert main(["policy", "check", str(DEFAULT_POLICY_PATH), "--drafters", PLAIN]) == 0
    out, err = capsys.readouterr()
    [warning] = [line for line in err.splitlines() if "'ngram'" in line]  # one line naming every field that names it
    fields = warning.removeprefix("warning: ").split(": 'ngram' is not configured")[0].split(", ")
    assert out.startswith("ok: policy ") and "domains.code.drafters" in fields and len(fields) > 1
    # a domain left with nothing the engine runs is an error
    only_ngram = tmp_path / "p.yaml"
    only_ngram.write_text(yaml.safe_dump({"version": "v", "default_domain": "a", "domains": {"a": {"drafters": ["ngram"]}}}))
    assert main(["policy", "check", str(only_ngram), "--drafters", PLAIN]) == 2
    err = capsys.readouterr().err
    assert "domains.a.drafters: none of ['ngram'] is configured" in err and "Traceback" not in err
    assert main(["policy", "check", str(DEFAULT_POLICY_PATH), "--drafters", "ngram,eagle"]) == 0
    assert capsys.readouterr().out.startswith("ok: policy ")


def test_cli_policy_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml" in err and "Traceback" not in err
