"""The router over the engine: routed output is plain decoding's, decisions are reported and
recorded, requests may force drafter and k, policies swap atomically, faults degrade to plain.

The tiny random target with three drafters (conftest: ngram, `self` = the target, accepts
everything, `other` = a different random model, accepts little); the shipped policy's routing
exercised on the real target in test_real_target.py."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import slow_device_waits
from test_engine import with_drafters

from policies.batching import BatchCost
from policies.records import PLAIN, StepRecord
from policies.schema import PolicyError, load_policy
from policies.selector import FALLBACK, FORCED
from policies.stats import MemoryStats, RedisStats
from workers.config import ModelDrafterConfig, TreeConfig
from workers.drafters.registry import build_drafter
from workers.engine import RequestError, SpecEngine
from workers.routing import (
    BATCH_COST_DENSE_ROWS,
    BATCH_COST_PREFILL_ROWS,
    COST_FACTOR_RANGE,
    RoutedBatch,
    RoutedGeneration,
    Router,
    Speculation,
    generate,
    measure_batch_cost,
    measure_costs,
)
from workers.sampling import SamplingParams

TEXTS = [
    "Summarize: the quick brown fox jumps over the lazy dog. The quick brown fox is quick.",
    "Write a poem about the sea and the sky and the sea again.",
    "def add(a, b):\n    return a + b\n\nExplain this function.",
]


def policy_dict(**domain: Any) -> dict[str, Any]:
    chat = {"drafters": ["self", "other", "ngram", "none"], "k_min": 1, "k_max": 8, **domain}
    priors = {"self": 0.6, "other": 0.3, "ngram": 0.4}
    chat["priors"] = {name: p for name, p in priors.items() if name in chat["drafters"]}
    return {
        "version": "test-1",
        "default_domain": "chat",
        "domains": {"chat": chat, "summarization": {"drafters": ["ngram", "none"], "k_max": 6},
                    "plainonly": {"drafters": ["none"]}},
        "classifier": {"rules": [{"domain": "summarization", "keywords": ["summarize"]}]},
        "exploration": {"min_samples": 4},
    }


@pytest.fixture()
def router(tiny_engine: SpecEngine) -> Router:
    return Router(tiny_engine, load_policy(policy_dict()), MemoryStats(), seed=0)


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


_plain: dict[str, list[int]] = {}


def plain_ids(engine: SpecEngine, text: str, max_tokens: int = 32) -> list[int]:
    key = f"{max_tokens}:{text}"
    if key not in _plain:
        _plain[key] = engine.generate(engine.encode(text), greedy(max_tokens)).token_ids
    return _plain[key]


def run(router: Router, text: str, speculation: Speculation | None = None, max_tokens: int = 32):
    return generate(router, router.engine.encode(text), greedy(max_tokens), text, speculation or Speculation())


@pytest.mark.parametrize("text", TEXTS)
def test_routed_output_is_plain_decoding(router: Router, text: str) -> None:
    for _ in range(3):  # statistics accumulate; later requests are planned from them
        routed = run(router, text)
        assert routed.token_ids == plain_ids(router.engine, text)


def test_report_and_records(router: Router) -> None:
    routed = run(router, TEXTS[0])
    report, result = routed.routing, routed
    assert (report.domain, report.domain_source, report.policy_version) == ("summarization", "rule", "test-1")
    assert report.drafter in ("ngram", PLAIN)
    assert sum(s.num_steps for s in report.schedule) == result.num_steps
    assert all(s.drafter in ("ngram", PLAIN) for s in report.schedule)  # the domain's drafters only
    snap = router.store.snapshot()
    steps = sum(c.num_steps for (d, _, _), c in snap.acceptance.items() if d == "summarization")
    assert steps == result.num_steps
    assert sum(n for (d, _, _), n in snap.decisions.items() if d == "summarization") == 1
    assert snap.histogram("ttft").count == 1 and snap.histogram("e2e").count == 1
    # ngram is cheap: every step scores it, whichever drafter ran
    shadow = snap.shadow_counts("summarization", "ngram")
    assert shadow.num_steps + snap.counts("summarization", "ngram").num_steps >= result.num_steps - 1


def test_cheap_first_lets_prompt_lookup_take_the_steps_it_matches(tiny_engine: SpecEngine) -> None:
    """With cheap_first, a request planned on a model drafter hands the steps where prompt lookup
    matches to it: both run within one request, the output stays plain decoding's, and the
    schedule and the records name the drafter of each step."""
    policy = policy_dict(drafters=["other", "ngram", "none"], cheap_first=True)
    policy["domains"]["chat"]["priors"] = {"other": 0.6, "ngram": 0.9}
    router = Router(tiny_engine, load_policy(policy), MemoryStats(), seed=0)
    text = "Count: one two three four five six seven eight nine ten one two"
    routed = generate(router, tiny_engine.encode(text, chat=False), greedy(48), text, Speculation())
    assert routed.token_ids == tiny_engine.generate(tiny_engine.encode(text, chat=False), greedy(48)).token_ids
    ran = {s.drafter for s in routed.steps}
    assert {"ngram", "other"} <= ran, ran
    assert sum(s.num_steps for s in routed.routing.schedule) == routed.num_steps
    assert {s.drafter for s in routed.routing.schedule} == ran
    counts = router.store.snapshot()
    assert counts.counts("chat", "ngram").num_steps == sum(s.drafter == "ngram" for s in routed.steps)


def test_router_learns_acceptance_and_plans_the_best_predicted_arm(router: Router) -> None:
    """`self` (the target itself) accepts every token, `other` little: a few requests teach the
    estimates that, and the plan is the arm with the best predicted speedup unless exploring.
    (Which arm that is depends on measured costs: `self` costs a target forward per token.)"""
    for name in ("self", "other", "self", "other"):  # the request names the drafter, the policy picks k
        assert run(router, TEXTS[1], Speculation(name)).token_ids == plain_ids(router.engine, TEXTS[1])
    routed = run(router, TEXTS[1])
    rs = router.start(router.engine.encode(TEXTS[1]), greedy(4), TEXTS[1])
    rs.close()
    estimates, arms = rs.plan.estimates, {a.drafter: a for a in rs.plan.arms}
    # prior 0.6 worth 4 observations; `self` was accepted every time, `other` seldom
    assert estimates["self"].prefix[0] > 0.85
    assert estimates["other"].prefix[0] < estimates["self"].prefix[0] - 0.3
    best = max(arms.values(), key=lambda a: a.predicted_speedup)
    if rs.plan.reason == "best":
        assert rs.plan.drafter == best.drafter
    assert routed.token_ids == plain_ids(router.engine, TEXTS[1])


@pytest.mark.parametrize("speculation, expect", [
    (Speculation(PLAIN), [(PLAIN, 0)]),
    (Speculation("other", 3), [("other", 3)]),
    (Speculation(draft_len=0), [(PLAIN, 0)]),
])
def test_forced_drafter_and_k(router: Router, speculation: Speculation, expect: list[tuple[str, int]]) -> None:
    routed = run(router, TEXTS[1], speculation)
    assert routed.token_ids == plain_ids(router.engine, TEXTS[1])
    assert [(s.drafter, s.draft_len) for s in routed.routing.schedule] == expect
    assert routed.routing.reason == FORCED


def test_forced_drafter_with_auto_k_never_falls_back(router: Router) -> None:
    routed = run(router, TEXTS[1], Speculation("other"))
    assert {s.drafter for s in routed.routing.schedule} == {"other"}
    assert routed.routing.fallbacks == ()


def test_domain_override_and_plain_only_domain(router: Router) -> None:
    routed = run(router, TEXTS[0], Speculation(domain="plainonly"))
    assert (routed.routing.domain, routed.routing.domain_source) == ("plainonly", "request")
    assert [s.drafter for s in routed.routing.schedule] == [PLAIN]


@pytest.mark.parametrize("speculation, param", [
    (Speculation("nope"), "speculation.drafter"),
    (Speculation(draft_len=99), "speculation.draft_len"),
    (Speculation(domain="nope"), "speculation.domain"),
])
def test_bad_speculation_names_the_field(router: Router, speculation: Speculation, param: str) -> None:
    with pytest.raises(RequestError) as e:
        run(router, TEXTS[0], speculation)
    assert e.value.param == param
    assert router.store.snapshot().decisions == {}  # refused requests record nothing


def test_policy_swap_is_atomic_and_validated(router: Router, tmp_path: Path) -> None:
    started = router.start(router.engine.encode(TEXTS[1]), greedy(8), TEXTS[1])
    new = policy_dict()
    new["version"] = "test-2"
    assert router.set_policy(load_policy(new)).version == "test-2"
    for bad, needle in [
        ("version: [", "not valid YAML"),
        ({**new, "default_domain": "nope"}, "default_domain"),
        ({**policy_dict(drafters=["eagle"]), "version": "x"}, "none of \\['eagle'\\]"),  # nothing it could run
        ({**new, "classifier": {"model": str(tmp_path / "missing")}}, "classifier.model"),
    ]:
        with pytest.raises(PolicyError, match=needle):
            router.set_policy(bad if isinstance(bad, str) else load_policy(bad))
        assert router.policy.version == "test-2"  # the running policy stays
    try:
        while not started.finished:
            started.step()
        assert started.report().policy_version == "test-1"  # a request keeps its policy
    finally:
        started.close()
    assert run(router, TEXTS[1]).routing.policy_version == "test-2"
    # a drafter the engine lacks is ignored: the domain runs what the engine has
    portable = {**policy_dict(drafters=["eagle", "ngram", "none"]), "version": "test-3"}
    assert router.set_policy(load_policy(portable)).version == "test-3"
    assert router.policy.domains["chat"].drafters == ["ngram", "none"]


class Exploding:
    """Wraps a drafter; raises on the n-th proposal."""

    def __init__(self, inner: Any, fail_on: int) -> None:
        self.inner, self.fail_on, self.calls = inner, fail_on, 0
        self.name, self.config, self.cheap = inner.name, inner.config, inner.cheap
        self.needs_hidden_states = inner.needs_hidden_states

    def begin(self, ctx: Any) -> Any:
        return self.inner.begin(ctx)

    def propose(self, state: Any, ctx: Any, k: int) -> Any:
        self.calls += 1
        if self.calls >= self.fail_on:
            raise RuntimeError("injected")
        return self.inner.propose(state, ctx, k)

    def commit(self, *args: Any) -> None:
        self.inner.commit(*args)

    def end(self, state: Any) -> None:
        self.inner.end(state)


def test_failing_drafter_degrades_to_plain(tiny_engine: SpecEngine) -> None:
    drafters = {**tiny_engine.drafters, "self": Exploding(tiny_engine.drafters["self"], fail_on=3)}
    engine = SpecEngine(tiny_engine.target, drafters, tiny_engine.config)
    router = Router(engine, load_policy(policy_dict(drafters=["self", "none"])), MemoryStats())
    routed = run(router, TEXTS[1], Speculation("self", 4))
    assert routed.token_ids == plain_ids(tiny_engine, TEXTS[1])
    assert routed.routing.fallbacks == ("drafter_error",)
    assert router.store.snapshot().fallbacks == {("chat", "drafter_error"): 1}


def test_dead_redis_never_fails_a_request(tiny_engine: SpecEngine) -> None:
    store = RedisStats("redis://127.0.0.1:1/0", timeout_s=0.05)
    router = Router(tiny_engine, load_policy(policy_dict()), store)
    routed = run(router, TEXTS[1])
    assert routed.token_ids == plain_ids(tiny_engine, TEXTS[1])
    health = store.health()
    assert not health.connected and health.num_pending_local > 0 and health.num_errors > 0
    store.close()


def test_plan_falls_back_when_every_drafter_loses(tiny_engine: SpecEngine) -> None:
    """Statistics in which the only drafter never gets a token accepted: the plan is plain."""
    store = MemoryStats()
    store.record_many([StepRecord("chat", "other", 4, 4, 0, draft_s=0.01, verify_s=0.02, context_len=30)] * 200)
    router = Router(tiny_engine, load_policy(policy_dict(drafters=["other", "none"])), store)
    routed = run(router, TEXTS[1])
    assert routed.routing.reason == FALLBACK and routed.routing.drafter == PLAIN
    assert routed.routing.fallbacks == ("low_speedup",)


def test_unfinished_request_still_records(router: Router) -> None:
    routed: RoutedGeneration = router.start(router.engine.encode(TEXTS[1]), greedy(32), TEXTS[1])
    for _ in range(3):
        routed.step()
    routed.close()  # the client went away
    snap = router.store.snapshot()
    assert sum(c.num_steps for c in snap.acceptance.values()) == 3


def test_measure_costs(tiny_engine: SpecEngine) -> None:
    costs = measure_costs(tiny_engine, context_len=16, repeats=1)
    assert len(costs.verify_s) == tiny_engine.config.max_draft_len + 1
    assert all(t > 0 for t in costs.verify_s)
    assert costs.plain_s == costs.verify_s[0]
    # the model drafters are priced from the start; n-gram lookup finds nothing to propose in the
    # probe's prompt, so it stays unpriced (0) until live steps measure it
    assert {"self", "other"} <= set(costs.draft_s_per_token) and "ngram" not in costs.draft_s_per_token
    assert all(t > 0 for t in costs.draft_s_per_token.values())


def test_measured_costs_wait_for_the_device(tiny_engine: SpecEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed forward waits for the device before the clock is read (a GPU forward returns at
    launch): a stand-in wait of 10 ms shows in every verify cost."""
    waits = slow_device_waits(monkeypatch, "workers.routing", 0.01)
    costs = measure_costs(tiny_engine, context_len=16, repeats=1)
    assert len(waits) == 2 * len(costs.verify_s)  # a warm-up round and one timed round
    assert min(costs.verify_s) >= 0.01


def test_the_batch_cost_is_measured_at_every_row_count_of_a_staircase(
    tiny_engine: SpecEngine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every row count up to the dense limit (a kernel's row blocks make the curve a staircase the
    goodput rule prices block by block), then doubling up to the scheduler's budget; each timed
    forward waits for the device; the curve never falls as rows grow."""
    waits = slow_device_waits(monkeypatch, "workers.routing", 0.002)
    cost = measure_batch_cost(tiny_engine, context_len=16, repeats=1)
    top = tiny_engine.config.scheduler.max_num_batched_tokens
    assert cost.rows[:BATCH_COST_DENSE_ROWS] == tuple(range(1, BATCH_COST_DENSE_ROWS + 1))
    assert cost.rows[BATCH_COST_DENSE_ROWS:] == (64, 128, 256)[: len(cost.rows) - BATCH_COST_DENSE_ROWS]
    assert cost.rows[-1] == top
    assert list(cost.seconds) == sorted(cost.seconds) and min(cost.seconds) >= 0.002
    warm_up = [n for n in cost.rows if n & (n - 1) == 0 or n == top]
    # prompt rows beside a decoding row, up to the budget less that row; the row alone as well
    assert cost.prefill_rows == (*(n for n in BATCH_COST_PREFILL_ROWS if n < top - 1), top - 1)
    assert list(cost.prefill_seconds) == sorted(cost.prefill_seconds) and min(cost.prefill_seconds) >= 0.0
    prefill_steps = 2 * (1 + len(cost.prefill_rows))  # a warm-up round and one timed round
    assert len(waits) == len(warm_up) + len(cost.rows) + prefill_steps


def test_a_routed_batch_shifts_the_cost_curve_per_batch_size(tiny_engine: SpecEngine) -> None:
    """A batch's step costs the measured one-sequence curve plus what steps of its size took
    beyond it: a step verifying no draft sets or moves its size's offset (a size not seen yet
    takes the nearest one's); one verifying drafts, once an offset is known, corrects the draft
    rows' price instead; one that also runs a prompt chunk corrects the prompt rows' price only.
    Routed outputs stay plain decoding's."""
    # a curve rising a little with every row (a measured one may be flat where timings tie)
    rows = tuple(range(1, 65))
    measured = BatchCost(rows, tuple(2e-3 + 1e-5 * n for n in rows), (1, 256), (5e-4, 2e-3))
    router = Router(tiny_engine, load_policy(policy_dict()), MemoryStats(), seed=0, batch_cost=measured)
    batch = RoutedBatch(router)
    running = [batch.add(tiny_engine.encode(t), greedy(16), t) for t in TEXTS[:2]]
    assert batch.step_cost(3) is measured  # nothing seen yet
    seen = {"prompt": 0, "draft": 0, "shift": 0}
    num_steps = 0
    while batch.num_running or batch.num_waiting:
        if num_steps == 3:  # its prompt runs beside the two decoding requests
            running.append(batch.add(tiny_engine.encode(TEXTS[2]), greedy(16), TEXTS[2]))
        offsets, prefill, draft = dict(batch.cost_offsets), batch.prefill_factor, batch.draft_row_factor
        step = batch.step()
        num_steps += 1
        n, rows = len(step.stats), step.batch.num_rows
        prompt_rows = sum(k for _, k in step.batch.prefilled)
        if not n:
            assert (batch.cost_offsets, batch.prefill_factor, batch.draft_row_factor) == (offsets, prefill, draft)
        elif prompt_rows:
            seen["prompt"] += 1
            assert batch.cost_offsets == offsets and batch.draft_row_factor == draft
            assert COST_FACTOR_RANGE[0] <= batch.prefill_factor <= COST_FACTOR_RANGE[1]
        elif rows > n and offsets:
            seen["draft"] += 1
            assert batch.cost_offsets == offsets and batch.prefill_factor == prefill
            assert batch.draft_row_factor != draft
            assert COST_FACTOR_RANGE[0] <= batch.draft_row_factor <= COST_FACTOR_RANGE[1]
        else:
            seen["shift"] += 1
            assert batch.prefill_factor == prefill and batch.draft_row_factor == draft
            excess = step.batch.forward_s - measured.rows_scaled(n, draft).step_s(rows)
            known = offsets.get(n)
            assert batch.cost_offsets[n] == pytest.approx(excess if known is None else known + 0.1 * (excess - known))
    assert all(seen.values()), seen
    n = max(batch.cost_offsets)
    offset = max(batch.cost_offsets[n], -0.5 * measured.seconds[0])
    plain = measured.step_s(n) + offset
    assert batch.step_cost(n).step_s(n) == pytest.approx(plain)
    assert batch.step_cost(n).step_s(n + 4) == pytest.approx(
        plain + batch.draft_row_factor * (measured.step_s(n + 4) - measured.step_s(n)))
    assert batch.step_cost(n + 5).step_s(n + 5) == pytest.approx(measured.step_s(n + 5) + offset)  # the nearest size's
    assert batch.step_cost(n).step_s(n, 40) == pytest.approx(plain + batch.prefill_factor * measured.prefill_s(40))
    for routed, text in zip(running, TEXTS[:3]):
        assert routed.result().token_ids == plain_ids(tiny_engine, text, 16)
        routed.close()


def test_a_routed_batch_decodes_plainly_where_routing_does_not_pay_but_keeps_forced_drafts(
    router: Router, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once routing a batch of a size is estimated to cost more host time than its drafts save,
    its steps ask no controller and draft nothing; a request that fixed its drafter and k still
    drafts, and every output stays plain decoding's."""
    engine = router.engine
    batch = RoutedBatch(router)
    forced = batch.add(engine.encode(TEXTS[0]), greedy(16), TEXTS[0], Speculation("self", 2))
    running = [batch.add(engine.encode(t), greedy(16), t) for t in TEXTS[1:]]
    for n in (2, 3):
        batch.fallback.observe(n, gain=0.0, overhead=1.0)
    asked: list[RoutedGeneration] = []
    choose = RoutedGeneration.choose
    monkeypatch.setattr(RoutedGeneration, "choose", lambda self: asked.append(self) or choose(self))
    plain_steps, forced_drafts = 0, 0
    while batch.num_running or batch.num_waiting:
        asked.clear()
        step = batch.step()
        if len(step.stats) < 2:
            assert step.routed  # a request alone re-plans itself
        elif not step.routed:
            plain_steps += 1
            assert set(asked) <= {forced}
            for routed, st in step.stats:
                if routed is forced:
                    forced_drafts += st.drafter == "self"
                else:
                    assert st.drafter == PLAIN
    assert plain_steps and forced_drafts
    for routed, text in zip([forced, *running], TEXTS):
        assert routed.result().token_ids == plain_ids(engine, text, 16)
        routed.close()


def test_a_routed_batch_scales_the_unitless_prior_to_seconds(router: Router) -> None:
    batch = RoutedBatch(router)
    running = [batch.add(router.engine.encode(t), greedy(8), t) for t in TEXTS[:2]]
    while batch.num_running or batch.num_waiting:
        batch.step()
    assert not batch.cost_offsets and batch.cost_scale < 0.5  # the prior's plain step is 1 (second)
    assert batch.step_cost(2).step_s(3) == pytest.approx(router.batch_cost.step_s(3) * batch.cost_scale)
    for routed in running:
        routed.close()


def test_a_tree_drafter_is_priced_by_the_tokens_it_verifies(tiny_engine: SpecEngine) -> None:
    """The verify curve reaches the tree's size and the policy prices its steps there: the same
    acceptance as the chain drafter, but a dearer step. Its routed output is plain decoding's."""
    tree = ModelDrafterConfig(name="self_tree", model=tiny_engine.config.drafters[1].model,
                              tree=TreeConfig(topk=3, nodes=20))
    config = tiny_engine.config.model_copy(update={"drafters": [*tiny_engine.config.drafters, tree]})
    engine = with_drafters(tiny_engine, config, self_tree=build_drafter(tree, tiny_engine.target))
    costs = measure_costs(engine, context_len=16, repeats=1)
    assert len(costs.verify_s) == 21 and costs.tree_sizes["self_tree"][:4] == (0, 3, 12, 20)
    assert costs.for_drafter("self_tree").step_s(2) == costs.draft_s_per_token["self_tree"] * 2 + costs.verify_s[12]
    router = Router(engine, load_policy(policy_dict(drafters=["self_tree", "none"], priors={"self_tree": 0.6})),
                    MemoryStats())
    assert router.costs is not None and router.costs.tree_sizes == costs.tree_sizes  # uncalibrated: the prior
    text = "Write a haiku about spring rain."
    out = run(router, text, Speculation(drafter="self_tree", draft_len=3))
    assert out.token_ids == plain_ids(engine, text)
    assert max(s.num_tree_nodes for s in out.steps) > 3


def test_decisions_are_reproducible(tiny_engine: SpecEngine) -> None:
    """Same seed, same request order, same statistics: the same plans (Thompson draws included)."""
    policy = policy_dict()
    policy["exploration"] = {"method": "thompson", "min_samples": 4}

    def plans() -> list[tuple[str, int]]:
        router = Router(tiny_engine, load_policy(policy), MemoryStats(), seed=7)
        out = []
        for text in TEXTS:
            r = router.start(tiny_engine.encode(text), greedy(4), text)
            out.append((r.plan.drafter, r.plan.draft_len))
            r.close()
        return out

    assert plans() == plans()
    random.seed(1)  # the global RNG plays no part
    assert plans() == plans()



def test_watched_policy_file_reloads_and_a_bad_one_is_refused(router: Router, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"

    def write(data: dict[str, Any] | str, mtime_ns: int) -> None:
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        os.utime(path, ns=(mtime_ns, mtime_ns))  # distinct mtimes, whatever the filesystem's resolution

    write(policy_dict(), 1_000_000_000)
    router.watch(path, every_s=5.0)
    assert not router.reload_if_changed(now=100.0)  # unchanged
    write({**policy_dict(), "version": "test-2"}, 2_000_000_000)
    assert not router.reload_if_changed(now=101.0)  # checked less than every_s ago: not yet
    assert router.reload_if_changed(now=106.0) and router.policy.version == "test-2"
    write("version: [broken", 3_000_000_000)
    assert not router.reload_if_changed(now=112.0)
    assert router.policy.version == "test-2"  # the running policy stays
    assert run(router, TEXTS[1]).routing.policy_version == "test-2"
    write({**policy_dict(), "version": "test-3"}, 4_000_000_000)
    assert router.reload_if_changed(now=118.0) and router.policy.version == "test-3"
    path.write_bytes(b"version: \xff\xfe\x00garbage")  # corrupted on disk: not even text
    os.utime(path, ns=(5_000_000_000, 5_000_000_000))
    assert not router.reload_if_changed(now=124.0) and router.policy.version == "test-3"
    path.unlink()  # a vanished file is a change that fails to load: the policy stays
    assert not router.reload_if_changed(now=130.0) and router.policy.version == "test-3"
