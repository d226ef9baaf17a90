"""A drafter on its own deployment (workers/drafters/remote.py): lossless like a colocated one,
one round trip per step, sessions that survive being served by another replica; and the real
Serve app with a DrafterWorker deployment over HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from helpers import TwoTokenCase, serve_tiny_app
from test_engine import TEXTS, greedy, perturbed_drafter, with_drafters  # noqa: F401  (fixture)

from workers.config import EngineConfig, ModelDrafterConfig, TreeConfig
from workers.drafters.model import ModelDrafter
from workers.drafters.remote import DraftCall, DraftReply, DraftSessions, RemoteDrafter
from workers.engine import PLAIN, SpecEngine
from workers.sampling import SamplingParams


class CountingService:
    """In-process DraftService over one or several DraftSessions 'replicas', called round-robin
    when `spread` (what a load balancer may do); counts calls."""

    def __init__(self, drafter: ModelDrafter, replicas: int = 1, spread: bool = False) -> None:
        self.replicas = [DraftSessions(drafter) for _ in range(replicas)]
        self.spread = spread
        self.num_calls = 0
        self.ended: list[str] = []

    def draft(self, call: DraftCall) -> DraftReply:
        self.num_calls += 1
        replica = self.replicas[self.num_calls % len(self.replicas)] if self.spread else self.replicas[0]
        return replica.draft(call)

    def end(self, session: str) -> None:
        self.ended.append(session)
        for replica in self.replicas:
            replica.end(session)


def remote_engine(engine: SpecEngine, drafter: ModelDrafter, service: CountingService) -> SpecEngine:
    vocab = engine.target.model.info.vocab_size
    return with_drafters(engine, remote=RemoteDrafter(drafter.config, service, vocab), local=drafter)


@pytest.mark.parametrize(("replicas", "spread"), [(1, False), (2, True)])
def test_remote_drafter_is_greedy_identical_with_one_call_per_step(
    tiny_engine: SpecEngine, perturbed_drafter: ModelDrafter, replicas: int, spread: bool,  # noqa: F811
) -> None:
    service = CountingService(perturbed_drafter, replicas, spread)
    engine = remote_engine(tiny_engine, perturbed_drafter, service)
    for text in TEXTS:
        prompt = engine.encode(text)
        plain = engine.generate(prompt, greedy(), PLAIN)
        local = engine.generate(prompt, greedy(), "local", 3)
        calls_before = service.num_calls
        remote = engine.generate(prompt, greedy(), "remote", 3)
        assert remote.token_ids == plain.token_ids
        # greedy proposals are deterministic: the remote drafter accepts exactly what the local one does
        assert remote.accepted_per_position == local.accepted_per_position
        assert service.num_calls - calls_before == sum(1 for s in remote.steps if s.num_draft_tokens or s.drafter != PLAIN)
    assert len(service.ended) == len(TEXTS)  # every session was ended
    assert all(not r.sessions for r in service.replicas)
    restarts = sum(r.num_restarts for r in service.replicas)
    assert (restarts > 0) == spread  # a session moved between replicas starts again there, nothing else


def test_remote_tree_drafter_is_greedy_identical(tiny_engine: SpecEngine, perturbed_drafter: ModelDrafter) -> None:  # noqa: F811
    """A draft tree's shape travels with the reply: the remote tree accepts what the local one does."""
    config = perturbed_drafter.config.model_copy(update={"tree": TreeConfig(topk=3, nodes=8)})
    tree_drafter = ModelDrafter(config, perturbed_drafter.model)
    engine = remote_engine(tiny_engine, tree_drafter, CountingService(tree_drafter))
    for text in TEXTS:
        prompt = engine.encode(text)
        plain = engine.generate(prompt, greedy(), PLAIN)
        local = engine.generate(prompt, greedy(), "local", 3)
        remote = engine.generate(prompt, greedy(), "remote", 3)
        assert remote.token_ids == plain.token_ids
        assert [s.num_tree_nodes for s in remote.steps] == [s.num_tree_nodes for s in local.steps]
        assert remote.accepted_per_position == local.accepted_per_position
        assert max(s.num_tree_nodes for s in remote.steps) > 3


def test_remote_sampled_output_follows_target_distribution(
    tiny_engine: SpecEngine, perturbed_drafter: ModelDrafter,  # noqa: F811
) -> None:
    """The drafter's probabilities travel back with its proposal: rejection sampling stays exact."""
    engine = remote_engine(tiny_engine, perturbed_drafter, CountingService(perturbed_drafter))
    results = TwoTokenCase.of(engine).check(engine, "remote", 1, 600)
    assert 0 < sum(r.num_accepted_tokens for r in results) < 600


def test_a_remote_drafter_races_a_seeded_requests_keyed_draws_as_a_local_one(
    tiny_engine: SpecEngine, perturbed_drafter: ModelDrafter,  # noqa: F811
) -> None:
    """The call carries that the request's draws are keyed (from its seed): the replica races the
    same draws, so the remote drafter proposes, and has accepted, what the local one does."""
    engine = remote_engine(tiny_engine, perturbed_drafter, CountingService(perturbed_drafter))
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=11)
    accepted = 0
    for text in TEXTS:
        prompt = engine.encode(text)
        local = engine.generate(prompt, params, "local", 3)
        remote = engine.generate(prompt, params, "remote", 3)
        assert remote.token_ids == local.token_ids
        assert remote.accepted_per_position == local.accepted_per_position
        accepted += remote.num_accepted_tokens
    assert accepted > 0


def test_a_failing_remote_degrades_to_plain(tiny_engine: SpecEngine, perturbed_drafter: ModelDrafter) -> None:  # noqa: F811
    class DeadService(CountingService):
        def draft(self, call: DraftCall) -> DraftReply:
            raise TimeoutError("draft call timed out")

    engine = remote_engine(tiny_engine, perturbed_drafter, DeadService(perturbed_drafter))
    prompt = engine.encode(TEXTS[0])
    result = engine.generate(prompt, greedy(), "remote", 3)
    assert result.token_ids == engine.generate(prompt, greedy(), PLAIN).token_ids
    assert {s.fallback_reason for s in result.steps} == {"drafter_error"}


def test_a_replica_of_another_vocabulary_refuses(tiny_config: EngineConfig, tmp_path: Path) -> None:
    from workers.deployment import DrafterWorker

    config = next(d for d in tiny_config.drafters if d.name == "other")
    worker = DrafterWorker.func_or_class(config.model_dump(mode="json"), tiny_config.target.model_dump(mode="json"))
    call = DraftCall("s", [1, 2, 3], 2, SamplingParams(), 64, worker.vocab_size + 1, 0)
    with pytest.raises(ValueError, match=rf"vocabulary size {worker.vocab_size} does not match the target's"):
        worker.draft(call)


# -- over HTTP: a DrafterWorker deployment -------------------------------------------------------------
def test_serve_app_with_a_drafter_deployment(tiny_config: EngineConfig, tmp_path: Path) -> None:
    from ray import serve

    drafters = [d if d.name != "other" else ModelDrafterConfig.model_validate(
        {**d.model_dump(mode="json"), "deployment": {"num_cpus": 0.5}}) for d in tiny_config.drafters]
    config = tiny_config.model_copy(update={"drafters": drafters})
    with serve_tiny_app(config, tmp_path, "tiny", num_cpus=0.5) as base_url:
        def complete(drafter: str) -> dict:
            body = {"prompt": "Count: one two three", "max_tokens": 24, "temperature": 0,
                    "speculation": {"drafter": drafter, "draft_len": 3}}
            r = requests.post(f"{base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        plain, remote = complete("none"), complete("other")
        assert remote["choices"][0]["text"] == plain["choices"][0]["text"]
        assert remote["speculation"]["drafters"] == ["other"] and remote["speculation"]["num_draft_tokens"] > 0
        status = serve.get_deployment_handle("DrafterWorker-other", app_name="specroute").status.remote().result()
        assert status["num_restarts"] == 0
        stats = requests.get(f"{base_url}/v1/stats", timeout=60).json()
        assert sum(d["drafters"]["other"]["all_time"]["num_draft_tokens"] for d in stats["domains"].values()) > 0
        # the round trip is the drafter's measured cost: the draft-stage histogram has its steps
        metrics = requests.get(f"{base_url}/metrics", timeout=60).text
        count = [line for line in metrics.splitlines()
                 if line.startswith("specroute_draft_stage_seconds_count") and 'drafter="other"' in line]
        assert count and float(count[0].rsplit(" ", 1)[1]) > 0, count
