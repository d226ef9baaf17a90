"""The router in front of the engine: classify a request, plan it from live statistics, re-plan
every step, and record every step in the stats store.

`Router` holds what requests share: the engine, the running policy and its classifier (swapped
together, atomically, on reload), the stats store and the measured step costs. `RoutedGeneration`
is one request: a `Generation` driven by the policy's `StepController`, whose steps also score
the domain's cheap drafters counterfactually. Records are buffered per request and flushed every
few steps, so a remote store costs one round trip per batch, never one per token.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from policies.classifier import Classification, DomainClassifier
from policies.cost import ALONE, RoundLoad
from policies.paths import PathNotAllowed, confine
from policies.records import Record, RequestRecord, ShadowRecord, StepRecord
from policies.schema import Policy, PolicyError, check_policy_drafters, load_policy
from policies.selector import FORCED, CostTable, Features, Plan, StepController, decide, forced_plan
from policies.stats import StatsStore
from workers.config import PLAIN, RoutingConfig
from workers.drafters.remote import RemoteDrafter
from workers.engine import Generation, GenerationResult, RequestError, SpecEngine, StepStats
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)

AUTO = "auto"
FLUSH_EVERY_STEPS = 16  # records buffered per request before a write to the store


@dataclass(frozen=True)
class Speculation:
    """What a request asks of the router (the `speculation` request field)."""

    drafter: str = AUTO  # AUTO: the policy chooses; PLAIN; or a configured drafter name
    draft_len: int | None = None  # None: the policy chooses k
    domain: str | None = None  # None: the classifier decides


@dataclass(frozen=True)
class Segment:
    """Consecutive steps with the same drafter and k."""

    drafter: str
    draft_len: int
    num_steps: int


@dataclass(frozen=True)
class RoutingReport:
    """How one request was routed; returned with its response."""

    domain: str
    domain_source: str  # request, rule, model or default
    confidence: float
    policy_version: str
    drafter: str  # the plan's drafter (PLAIN: the request started plain)
    draft_len: int
    reason: str  # the plan's reason: best, explore, fallback, policy or forced
    predicted_speedup: float
    schedule: tuple[Segment, ...]  # the (drafter, k) asked for each step, run-length encoded
    fallbacks: tuple[str, ...]  # the reason of each switch to plain decoding

    @property
    def fallback_reason(self) -> str | None:
        return self.fallbacks[-1] if self.fallbacks else None


@dataclass
class RoutedResult:
    generation: GenerationResult
    routing: RoutingReport


def measure_costs(engine: SpecEngine, context_len: int = 64, repeats: int = 3) -> CostTable:
    """The step costs of this deployment: the verify curve, the best of `repeats` target forwards
    over 1 + k tokens after a `context_len`-token prefix, k = 0..max_draft_len (or the biggest
    draft tree's size); and each drafter's seconds per draft token (`measure_draft_costs`). The
    policy's cost prior until live statistics measure the real traffic."""
    model = engine.target.model
    # the curve reaches the biggest draft tree's size: the policy prices a tree step by its tokens
    max_k = max([engine.config.max_draft_len, *(sizes[-1] for sizes in tree_sizes(engine).values())])
    context_len = max(1, min(context_len, engine.max_model_len - max_k - 1))
    vocab = model.info.vocab_size
    ids = torch.arange(context_len + max_k + 1, device=model.device) * 7919 % vocab
    cache = model.new_cache(context_len + max_k + 1)
    model.forward(ids[:context_len], cache, last_only=True)
    best = [float("inf")] * (max_k + 1)
    for _ in range(repeats + 1):  # the first round warms up
        for k in range(max_k + 1):
            t0 = time.perf_counter()
            model.forward(ids[context_len : context_len + k + 1], cache)
            elapsed = time.perf_counter() - t0
            cache.truncate(context_len)
            best[k] = min(best[k], elapsed)
    return CostTable(tuple(best), measure_draft_costs(engine, ids[:context_len].tolist(), repeats), tree_sizes(engine))


def tree_sizes(engine: SpecEngine) -> dict[str, tuple[int, ...]]:
    """Per tree drafter, the draft tokens a step verifies at each depth 0..max_draft_len: what
    the policy prices its verify forward by (a chain verifies k)."""
    return {d.name: tuple(d.tree.size(k) for k in range(engine.config.max_draft_len + 1))
            for d in engine.config.drafters if getattr(d, "tree", None) is not None}


def measure_draft_costs(engine: SpecEngine, prompt: list[int], repeats: int, k: int = 4) -> dict[str, float]:
    """Each drafter's best seconds per draft token over `repeats` real steps drafting k tokens on
    `prompt`, after one that warms it up (and feeds it the prompt). A drafter that proposes
    nothing here (n-gram lookup on a prompt without repeats) or fails is left out: its cost stays
    0 until live steps measure it; so is a drafter on its own deployment, whose replicas may not
    be up yet while this replica starts."""
    out: dict[str, float] = {}
    for name, drafter in engine.drafters.items():
        if isinstance(drafter, RemoteDrafter):
            continue
        gen = engine.start(prompt, SamplingParams(max_tokens=(repeats + 1) * (k + 1), ignore_eos=True))
        try:
            steps = [gen.step(name, k) for _ in range(repeats + 1)][1:]
        finally:
            gen.close()
        costs = [s.draft_s / s.num_draft_tokens for s in steps if s.drafter == name and s.num_draft_tokens]
        if costs:
            out[name] = min(costs)
    return out


class Router:
    def __init__(
        self, engine: SpecEngine, policy: Policy, store: StatsStore, *, classifier: DomainClassifier | None = None,
        costs: CostTable | None = None, seed: int = 0, allowed_dirs: tuple[Path, ...] | None = None,
    ) -> None:
        """`allowed_dirs`: where a policy's classifier may be read from (policies.paths); None: anywhere."""
        self.engine = engine
        self.store = store
        self.allowed_dirs = allowed_dirs
        if (sizes := tree_sizes(engine)):  # the policy must know what a tree step verifies
            costs = replace(costs or CostTable.relative(), tree_sizes=sizes)
        self.costs = costs
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._active: tuple[Policy, DomainClassifier] = self._prepare(policy, classifier)
        self._watched: Path | None = None
        self._watch_s = 0.0
        self._next_check = 0.0
        self._mtime_ns: int | None = None

    @classmethod
    def from_config(cls, engine: SpecEngine, config: RoutingConfig, store: StatsStore,
                    allowed_dirs: tuple[Path, ...] | None = None) -> Router:
        costs = measure_costs(engine) if config.calibrate else None
        path = config.policy_path()
        router = cls(engine, load_policy(path), store, costs=costs, seed=config.seed, allowed_dirs=allowed_dirs)
        if config.watch_s > 0:
            router.watch(path, config.watch_s)
        return router

    # -- policy -------------------------------------------------------------------------------
    def _prepare(self, policy: Policy, classifier: DomainClassifier | None = None) -> tuple[Policy, DomainClassifier]:
        """Check a policy against this engine and load its classifier; raises PolicyError."""
        usable = check_policy_drafters(policy, set(self.engine.drafters))
        for line in usable.ignored:
            log.warning("policy %r: %s; ignored", policy.version, line)
        policy = usable.policy
        if policy.classifier.model and self.allowed_dirs is not None:
            try:
                confine(policy.classifier.model, self.allowed_dirs, "classifier.model")
            except PathNotAllowed as e:
                raise PolicyError(str(e)) from None
        if classifier is None:
            try:
                classifier = DomainClassifier.from_policy(policy)
            except (OSError, ValueError) as e:
                raise PolicyError(f"classifier.model: cannot load {policy.classifier.model!r}: {e}") from None
        return policy, classifier

    @property
    def policy(self) -> Policy:
        return self._active[0]

    def set_policy(self, policy: Policy | str | Path) -> Policy:
        """Validate and swap in a policy (a Policy, YAML text or a path). A bad one raises
        PolicyError and the running policy stays; a request keeps the policy it started with."""
        if not isinstance(policy, Policy):
            policy = load_policy(policy)
        prepared = self._prepare(policy)
        self._active = prepared  # one reference assignment: readers see the old pair or the new
        log.info("routing policy %r in force", policy.version)
        return policy

    def watch(self, path: Path, every_s: float) -> None:
        """Reload the policy from `path` when the file changes (see `reload_if_changed`)."""
        self._watched, self._watch_s = path, every_s
        self._mtime_ns = _mtime_ns(path)

    def reload_if_changed(self, now: float | None = None) -> bool:
        """Swap in the watched policy file if it changed since last looked at (at most every
        `every_s` seconds). A bad file is logged and the running policy stays; the same file is
        not tried again until it changes. True when a new policy is in force."""
        now = time.monotonic() if now is None else now
        if self._watched is None or now < self._next_check:
            return False
        self._next_check = now + self._watch_s
        mtime = _mtime_ns(self._watched)
        if mtime == self._mtime_ns:
            return False
        self._mtime_ns = mtime
        try:
            self.set_policy(self._watched)
        except PolicyError as e:
            log.error("policy file %s refused, policy %r stays in force: %s", self._watched, self.policy.version, e)
            return False
        return True

    # -- requests -----------------------------------------------------------------------------
    def start(
        self, prompt_ids: list[int], params: SamplingParams, text: str,
        speculation: Speculation = Speculation(),
    ) -> RoutedGeneration:
        """Classify, plan and prefill one request. Raises RequestError for a bad request."""
        policy, classifier = self._active
        drafter, k = speculation.drafter, speculation.draft_len
        if drafter not in (AUTO, PLAIN) and drafter not in self.engine.drafters:
            known = ", ".join([AUTO, PLAIN, *self.engine.drafters])
            raise RequestError(f"unknown drafter {drafter!r}; configured: {known}", "speculation.drafter")
        if k is not None and not 0 <= k <= self.engine.config.max_draft_len:
            raise RequestError(f"draft_len {k} is outside [0, {self.engine.config.max_draft_len}]",
                               "speculation.draft_len")
        self.engine.check_request(prompt_ids, params)
        try:
            classification = classifier.predict(text, speculation.domain)
        except ValueError as e:
            raise RequestError(str(e).split(": ", 1)[-1], "speculation.domain") from None
        domain = classification.domain
        dp = policy.domains[domain]
        features = Features(domain, len(prompt_ids))
        if drafter == PLAIN or k == 0:
            plan = forced_plan(domain, PLAIN, 0)
        elif drafter != AUTO and k is not None:
            plan = forced_plan(domain, drafter, k)
        else:
            candidates = [d for d in dp.drafters if d == PLAIN or d in self.engine.drafters]
            if drafter != AUTO:  # the request names its drafter; the policy picks k
                candidates = [drafter]
            snapshot = self.store.snapshot(window_s=policy.window.seconds)  # I/O with Redis: outside the lock
            with self._lock:  # one rng, shared: draws in request order
                plan = decide(features, snapshot, policy, self._rng, self.costs, candidates)
            if k is not None:  # the policy picks the drafter; the request fixed k
                plan = forced_plan(domain, plan.drafter, k) if plan.drafter != PLAIN else plan
            elif drafter != AUTO:
                plan = Plan(domain, drafter, plan.draft_len or dp.k_min, plan.predicted_speedup, FORCED,
                            plan.arms, plan.estimates, plan.costs)
        controller = StepController(
            plan, dp, policy.exploration, cheap=[d for d in plan.estimates if self.engine.drafters[d].cheap],
            allow_plain=drafter == AUTO, adaptive=k is None,
        )
        # cheap drafters the domain allows are scored on every step, whichever one runs
        shadow = [d for d in dp.drafters if d in self.engine.drafters and self.engine.drafters[d].cheap]
        gen = self.engine.start(prompt_ids, params)
        return RoutedGeneration(self, gen, policy, classification, plan, controller, shadow)


class RoutedGeneration:
    """One request under the router: `step()` until `finished`, then `result()`; `close()` always."""

    def __init__(
        self, router: Router, gen: Generation, policy: Policy, classification: Classification, plan: Plan,
        controller: StepController, shadow: Sequence[str],
    ) -> None:
        self.router, self.gen, self.policy = router, gen, policy
        self.classification, self.plan, self.controller = classification, plan, controller
        self.shadow = tuple(shadow)
        self.domain = plan.domain
        self._records: list[Record] = []
        self._t0 = time.perf_counter()
        self._ttft_s: float | None = None
        self._schedule: list[Segment] = []
        self._recorded = False

    @property
    def finished(self) -> bool:
        return self.gen.finished

    def step(self, load: RoundLoad = ALONE) -> StepStats:
        """One step; `load`: the other requests this replica interleaves with this one."""
        self.controller.load = load
        choice = self.controller.next()
        stats = self.gen.step(choice.drafter, choice.draft_len, shadow=self.shadow, first=choice.first_drafter,
                              first_len=choice.first_len)
        if stats.fallback_reason is not None or stats.draft_len > 0:  # not a step clipped to k = 0 at the end
            self.controller.observe(stats.drafter, stats.num_draft_tokens, stats.num_accepted)
        self._records.append(StepRecord.from_step(self.domain, stats))
        for score in stats.shadows:
            self.controller.observe_shadow(score.drafter, score.start, score.num_proposed, score.num_accepted)
            self._records.append(ShadowRecord.from_score(self.domain, score))
        if self._ttft_s is None:
            self._ttft_s = time.perf_counter() - self._t0
        if stats.drafter == choice.first_drafter:  # the cheap drafter proposed: it ran the step
            self._extend_schedule(stats.drafter, choice.first_len)
        else:
            self._extend_schedule(choice.drafter, choice.draft_len)
        if self.finished:
            self._finish()
        elif len(self._records) >= FLUSH_EVERY_STEPS:
            self._flush()
        return stats

    def _extend_schedule(self, drafter: str, k: int) -> None:
        last = self._schedule[-1] if self._schedule else None
        if last is not None and (last.drafter, last.draft_len) == (drafter, k):
            self._schedule[-1] = Segment(drafter, k, last.num_steps + 1)
        else:
            self._schedule.append(Segment(drafter, k, 1))

    def _flush(self) -> None:
        records, self._records = self._records, []
        if records:
            try:
                self.router.store.record_many(records)
            except Exception:  # statistics must never fail a request
                log.exception("could not record %d routing records", len(records))

    def _finish(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        e2e = time.perf_counter() - self._t0
        self._records.append(RequestRecord(
            self.domain, self.plan.drafter, self.plan.reason, ttft_s=min(self._ttft_s or e2e, e2e), e2e_s=e2e,
            fallbacks=self.fallbacks,
        ))
        self._flush()

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return tuple(self.controller.fallbacks)

    def report(self) -> RoutingReport:
        c = self.classification
        return RoutingReport(
            domain=self.domain, domain_source=c.source, confidence=c.confidence,
            policy_version=self.policy.version, drafter=self.plan.drafter, draft_len=self.plan.draft_len,
            reason=self.plan.reason, predicted_speedup=self.plan.predicted_speedup,
            schedule=tuple(self._schedule), fallbacks=self.fallbacks,
        )

    def result(self) -> RoutedResult:
        return RoutedResult(self.gen.result(), self.report())

    def close(self) -> None:
        """Release the generation; an unfinished request's records are still written."""
        if not self.gen.closed:
            self.gen.close()
        if not self.finished:
            self._flush()


def round_load(others: Sequence[tuple[int, float] | None], plain_s: float | None) -> RoundLoad:
    """A request's RoundLoad from the latest step of every other request on the replica, (tokens
    emitted, seconds), None before its first: their sums, in plain steps of `plain_s` seconds.
    Without a measured plain step (no calibration) the request is planned as if alone."""
    known = [s for s in others if s is not None]
    if not plain_s or plain_s <= 0 or not known:
        return ALONE
    return RoundLoad(sum(t for t, _ in known), sum(s for _, s in known) / plain_s)


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def generate(router: Router, prompt_ids: list[int], params: SamplingParams, text: str,
             speculation: Speculation = Speculation()) -> RoutedResult:
    """One routed request from start to finish (CLI, bench)."""
    routed = router.start(prompt_ids, params, text, speculation)
    try:
        while not routed.finished:
            routed.step()
        return routed.result()
    finally:
        routed.close()
