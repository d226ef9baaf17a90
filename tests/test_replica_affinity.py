"""Which target replica serves a request (router/replica_affinity.py): the affinity key and the
rendezvous order as pure functions, then a real Serve app of two replicas, where every turn of a
conversation reaches the replica holding its earlier turns' prefix."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from helpers import serve_tiny_app

from router.replica_affinity import affine_ranks, affinity_key, rendezvous_order
from workers.config import EngineConfig
from workers.deployment import GenerateRequest

MODEL = "tiny-test-model"


def _chat(*turns: str, salt: str | None = None) -> GenerateRequest:
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": "Be brief."}]
    messages += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return GenerateRequest(prompt=messages, cache_salt=salt)


def test_a_conversation_keeps_its_key_and_salts_and_openings_part_keys() -> None:
    first = affinity_key(_chat("Plan a trip to Rome."))
    assert affinity_key(_chat("Plan a trip to Rome.", "Day one: the Forum.", "And day two?")) == first
    assert affinity_key(_chat("Plan a trip to Oslo.")) != first
    assert affinity_key(_chat("Plan a trip to Rome.", salt="tenant-a")) != first
    text = "Summarize: " + "lorem ipsum " * 200
    assert affinity_key(GenerateRequest(prompt=text)) == affinity_key(GenerateRequest(prompt=text + " and more"))
    assert affinity_key(GenerateRequest(prompt="", prompt_token_ids=(1, 2, 3))) != affinity_key(
        GenerateRequest(prompt="", prompt_token_ids=(1, 2, 4)))


def test_rendezvous_order_moves_only_what_a_leaving_replica_held() -> None:
    replicas = ["r-a", "r-b", "r-c", "r-d"]
    keys = [f"conversation-{i}" for i in range(2000)]
    first = {k: replicas[rendezvous_order(k, replicas)[0]] for k in keys}
    shares = Counter(first.values())
    assert set(shares) == set(replicas) and min(shares.values()) > 400  # ~500 each
    left = [r for r in replicas if r != "r-c"]
    after = {k: left[rendezvous_order(k, left)[0]] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != "r-c")  # the others' keys stay
    assert sorted(rendezvous_order("k", replicas)) == list(range(4))


def test_a_busier_preferred_replica_gives_way_to_the_least_loaded() -> None:
    order = [2, 0, 1]  # replica 2 preferred
    assert affine_ranks(order, [0, 0, 2], max_imbalance=2) == [[2], [0, 1]]
    assert affine_ranks(order, [1, 0, 3], max_imbalance=2) == [[0, 1, 2]]  # one past the allowance: all alike
    assert affine_ranks(order, [1, 1, 1], max_imbalance=0) == [[2], [0, 1]]
    assert affine_ranks(order, [0, 1, 1], max_imbalance=0) == [[0, 1, 2]]


@pytest.fixture(scope="module")
def base_url(tiny_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    scheduler = tiny_config.scheduler.model_copy(update={"enable_prefix_caching": True})
    with serve_tiny_app(tiny_config.model_copy(update={"scheduler": scheduler}), tmp_path_factory.mktemp("serve"),
                        MODEL, num_replicas=2) as url:
        yield url


def test_every_turn_of_a_conversation_finds_its_earlier_turns(base_url: str) -> None:
    """Two replicas, each holding the prefixes it served: a conversation's second and third turns
    go where its first went, so each finds the whole earlier conversation's prompt cached (Serve's
    random choice between two replicas would miss half the time)."""
    def turn(messages: list[dict]) -> dict:
        body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
        r = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    for topic in ["Rome", "Oslo", "Lima", "Kyoto", "Cairo", "Quito"]:
        messages = [{"role": "system", "content": "You plan trips, briefly."},
                    {"role": "user", "content": f"Plan a day in {topic}."}]
        earlier = turn(messages)
        for again in ["And the next day?", "And the day after?"]:
            messages += [{"role": "assistant", "content": earlier["choices"][0]["message"]["content"]},
                         {"role": "user", "content": again}]
            later = turn(messages)
            assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= earlier["usage"]["prompt_tokens"] - 1
            earlier = later


def test_the_choices_of_one_request_are_all_served(base_url: str) -> None:
    """`n` choices share their HTTP request's internal id: each is routed, none is left waiting."""
    body = {"model": MODEL, "prompt": ["Once upon a time", "The weather today is"], "n": 3, "max_tokens": 4}
    r = requests.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(6))


def test_load_runs_conversations_that_find_their_earlier_turns(base_url: str, tmp_path: Path) -> None:
    """`specroute load --turns 3`: each later turn carries the earlier ones and their answers, and
    finds most of its prompt cached on the replica its conversation keeps to."""
    from bench.load import LoadArgs, run_load, write_load_report
    from bench.prompts import BenchPrompt

    prompts = [BenchPrompt(i, "chat", f"Plan a day in {city}.") for i, city in enumerate(["Rome", "Oslo", "Lima"])]
    run = run_load(LoadArgs(base_url, prompts, clients=3, duration_s=4.0, max_tokens=8, speculation="auto",
                            model=MODEL, turns=3))
    assert run["errors"] == 0 and run["later_turns"] >= 3, run
    assert run["cached_tokens"] < run["prompt_tokens"] and run["later_cached_share"] > 0.6, run
    report = write_load_report([run], tmp_path, "specroute load --turns 3").read_text()
    assert "conversations of 3 turns" in report and "later turns found" in report
