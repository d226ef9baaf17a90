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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from policies.batching import BatchCost, BatchFallback, DraftOption, Forecast, allocate, cascade, forecast
from policies.classifier import Classification, DomainClassifier
from policies.controller import StepChoice, StepController
from policies.cost import CostTable
from policies.paths import PathNotAllowed, confine
from policies.records import ContextSpan, Record, RequestRecord, ShadowRecord, StepRecord, context_bucket
from policies.schema import Policy, PolicyError, check_policy_drafters, load_policy
from policies.selector import FALLBACK, FORCED, Features, Plan, decide, forced_plan
from policies.stats import StatsStore
from workers import calibration
from workers.batch import BatchEngine, BatchStep
from workers.config import AUTO, PLAIN, LookaheadDrafterConfig, RoutingConfig, check_speculation
from workers.drafters.remote import RemoteDrafter
from workers.engine import Generation, SpecEngine, StepOrder
from workers.models.base import BatchedLM, CausalLM, SeqInput, forward_rows, release_freed_memory, synchronize
from workers.result import GenerationResult, RequestError, RoutingReport, Segment, StepStats
from workers.sampling import SamplingParams
from workers.shadows import CheapDrafters

log = logging.getLogger(__name__)

FLUSH_EVERY_STEPS = 16  # records buffered per request before a write to the store


@dataclass(frozen=True)
class Speculation:
    """What a request asks of the router (the `speculation` request field)."""

    drafter: str = AUTO  # AUTO: the policy chooses; PLAIN; or a configured drafter name
    draft_len: int | None = None  # None: the policy chooses k
    domain: str | None = None  # None: the classifier decides


def measure_costs(engine: SpecEngine, context_len: int = 64, repeats: int = 3) -> CostTable:
    """The step costs of this deployment: the verify curve, the best of `repeats` target forwards
    over 1 + k tokens after a `context_len`-token prefix, k = 0..max_draft_len (or the biggest
    draft tree's size); and each drafter's seconds per draft token (`measure_draft_costs`). The
    policy's cost prior until live statistics measure the real traffic."""
    model = engine.target.model
    # the curve reaches the biggest draft tree's size: the policy prices a tree step by its tokens
    max_k = max([engine.config.max_draft_len, *(sizes[-1] for sizes in tree_sizes(engine).values())])
    context_len = max(1, min(context_len, engine.max_model_len - max_k - 1))
    ids = _probe_ids(model, context_len + max_k + 1)
    cache = model.new_cache(context_len + max_k + 1)
    model.forward(ids[:context_len], cache, last_only=True)
    best = [float("inf")] * (max_k + 1)
    for _ in range(repeats + 1):  # the first round warms up
        for k in range(max_k + 1):
            t0 = time.perf_counter()
            model.forward(ids[context_len : context_len + k + 1], cache)
            synchronize(model.device)
            elapsed = time.perf_counter() - t0
            cache.truncate(context_len)
            best[k] = min(best[k], elapsed)
    return CostTable(tuple(best), measure_draft_costs(engine, ids[:context_len].tolist(), repeats), tree_sizes(engine))


# rows the batch cost curve is measured at: every count up to BATCH_COST_DENSE_ROWS (a kernel that
# computes rows in blocks makes the curve a staircase: with torch's int4 CPU kernel, 4 rows a block,
# a step's 5th row costs a third of a plain step and each of the next three ~5%), then doubling
BATCH_COST_DENSE_ROWS = 48
BATCH_COST_ROWS = (*range(1, BATCH_COST_DENSE_ROWS + 1), 64, 128, 256, 512)
# prompt rows the batch cost's prefill curve is measured at (and the token budget less one decoding row):
# the first costs most (on an int4 target, a read of the dense weights prompt rows run on), then ~linear
BATCH_COST_PREFILL_ROWS = (1, 8, 32, 128, 512)


def measure_batch_cost(engine: SpecEngine, context_len: int = 64, repeats: int = 2) -> BatchCost:
    """T(rows): the best of `repeats` target forwards over n rows after a `context_len`-token
    prefix, for n up to the scheduler's token budget (and the largest verify a step may run),
    made non-decreasing (a slow outlier takes the time of a larger n); and what a step's prompt
    rows add to it (`measure_prefill_cost`)."""
    model = engine.target.model
    top = max(engine.config.scheduler.max_num_batched_tokens, engine.config.max_draft_len + 1)
    rows = [n for n in BATCH_COST_ROWS if n < top] + [top]
    context_len = max(1, min(context_len, engine.max_model_len - top))
    ids = _probe_ids(model, context_len + top)
    cache = model.new_cache(context_len + top)
    model.forward(ids[:context_len], cache, last_only=True)

    def forward_s(n: int) -> float:
        t0 = time.perf_counter()
        model.forward(ids[context_len : context_len + n], cache)
        synchronize(model.device)
        elapsed = time.perf_counter() - t0
        cache.truncate(context_len)
        return elapsed

    for n in rows:  # warm up every kernel: the powers of two run the same ones as the counts between
        if n & (n - 1) == 0 or n == top:
            forward_s(n)
    best = [float("inf")] * len(rows)
    for _ in range(repeats):
        for i, n in enumerate(rows):
            best[i] = min(best[i], forward_s(n))
    prefill_rows = [n for n in BATCH_COST_PREFILL_ROWS if n < top - 1] + [max(1, top - 1)]
    prefill_s = measure_prefill_cost(engine, prefill_rows, context_len, repeats)
    return BatchCost(tuple(rows), _non_decreasing(best), tuple(prefill_rows), prefill_s)


def measure_prefill_cost(engine: SpecEngine, rows: Sequence[int], context_len: int, repeats: int) -> tuple[float, ...]:
    """What p prompt rows add to a step, for each p of `rows`: the best of `repeats` steps of one
    decoding row beside a chunk of p prompt rows, less the best step of the row alone, both
    sequences after `context_len` tokens; made non-decreasing."""
    model = engine.target.model
    top = max(rows)
    ids = _probe_ids(model, context_len + top)
    if isinstance(model, BatchedLM):
        pool = model.new_pool(2, context_len + top)
        decoding, prompt = pool.allocate(), pool.allocate()
    else:
        decoding, prompt = model.new_cache(context_len + 1), model.new_cache(context_len + top)
    forward_rows(model, [SeqInput(ids[:context_len], c, "none") for c in (decoding, prompt)])

    def step_s(p: int) -> float:
        inputs = [SeqInput(ids[context_len : context_len + 1], decoding, "all")]
        if p:
            inputs.append(SeqInput(ids[context_len : context_len + p], prompt, "none"))
        t0 = time.perf_counter()
        forward_rows(model, inputs)
        synchronize(model.device)
        elapsed = time.perf_counter() - t0
        decoding.truncate(context_len)
        prompt.truncate(context_len)
        return elapsed

    counts = [0, *rows]
    for p in counts:  # warm up
        step_s(p)
    best = [min(step_s(p) for _ in range(repeats)) for p in counts]
    return _non_decreasing([max(0.0, t - best[0]) for t in best[1:]])


def _probe_ids(model: CausalLM, n: int) -> torch.Tensor:
    """n token ids spread over the vocabulary: the calibration's inputs (their values do not move a forward's time)."""
    return torch.arange(n, device=model.device) * 7919 % model.info.vocab_size


def _non_decreasing(seconds: Sequence[float]) -> tuple[float, ...]:
    """Each time, or a later one where that is smaller: a slow outlier takes the time of more rows."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)


def relative_batch_cost(costs: CostTable) -> BatchCost:
    """T(rows) from the single-sequence verify curve when the batch was not measured."""
    return BatchCost(tuple(range(1, len(costs.verify_s) + 1)), tuple(costs.verify_s))


def tree_sizes(engine: SpecEngine) -> dict[str, tuple[int, ...]]:
    """Per tree drafter (a `tree` config, or lookahead's window and guesses), the draft tokens a
    step verifies at each k = 0..max_draft_len: what the policy prices its verify forward by (a
    chain verifies k)."""
    sizes = {}
    for d in engine.config.drafters:
        ks = range(engine.config.max_draft_len + 1)
        if isinstance(d, LookaheadDrafterConfig):
            sizes[d.name] = tuple(d.size(k) for k in ks)
        elif (tree := getattr(d, "tree", None)) is not None:
            sizes[d.name] = tuple(tree.size(k) for k in ks)
    return sizes


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


def _measure(engine: SpecEngine) -> tuple[CostTable, BatchCost]:
    costs, batch_cost = measure_costs(engine), measure_batch_cost(engine)
    release_freed_memory()  # the measuring forwards' temporaries (prompt chunks of up to thousands of rows)
    return costs, batch_cost


def calibrate(engine: SpecEngine, reuse: bool = True) -> calibration.Calibration:
    """The step costs and the batch's step cost of this deployment: measured, or (`reuse`) read
    back from the calibration an earlier start kept for the same engine, models, code and
    machine (workers/calibration.py), which a measurement then keeps."""
    if not reuse:
        return calibration.Calibration(*_measure(engine))
    ident = calibration.identity(engine.config, engine.target.source_dir, engine.target.model.device)
    path = calibration.calibration_path(engine.config, ident)
    if (kept := calibration.load(path, ident)) is not None:
        return kept
    t0 = time.perf_counter()
    costs, batch_cost = _measure(engine)
    origin = f"measured in {time.perf_counter() - t0:.1f} s, kept at {path}"
    measured = calibration.Calibration(costs, batch_cost, origin)
    calibration.save(path, ident, measured)
    return measured


class Router:
    def __init__(
        self, engine: SpecEngine, policy: Policy, store: StatsStore, *, classifier: DomainClassifier | None = None,
        costs: CostTable | None = None, seed: int = 0, allowed_dirs: tuple[Path, ...] | None = None,
        batch_cost: BatchCost | None = None,
    ) -> None:
        """`allowed_dirs`: where a policy's classifier may be read from (policies.paths); None: anywhere.
        `batch_cost`: the target forward's seconds by rows (the batch's goodput rule); None: the
        verify curve of `costs`, extended along its slope."""
        self.engine = engine
        self.store = store
        self.allowed_dirs = allowed_dirs
        if (sizes := tree_sizes(engine)):  # the policy must know what a tree step verifies
            costs = replace(costs or CostTable.relative(), tree_sizes=sizes)
        self.costs = costs
        # cheap chain drafters are asked for max_draft_len on every step they are scored (shadows):
        # their statistics say how far they propose (policies/acceptance.py, Acceptance.own_length)
        self.own_length = frozenset(name for name, d in engine.drafters.items() if d.cheap and name not in sizes)
        self.batch_cost = batch_cost or relative_batch_cost(costs or CostTable.relative())
        self.batch_cost_in_seconds = batch_cost is not None  # else the prior, in plain steps
        self.calibration_origin = "not measured"  # the replica's log: from_config says where it came from
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
        prior = calibrate(engine, config.calibration_cache) if config.calibrate else None
        path = config.policy_path()
        router = cls(engine, load_policy(path), store, costs=prior.costs if prior else None, seed=config.seed,
                     allowed_dirs=allowed_dirs, batch_cost=prior.batch_cost if prior else None)
        if prior is not None:
            router.calibration_origin = prior.origin
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
        speculation: Speculation = Speculation(), batch: BatchEngine | None = None, priority: int = 0,
        cache_salt: str | None = None,
    ) -> RoutedGeneration:
        """Classify, plan and prefill one request (`batch`: queue it there instead, prefilled
        by the batch's steps, with `priority`), sharing cached state with requests of its
        `cache_salt` alone. Raises RequestError for a bad request."""
        policy, classifier = self._active
        drafter, k = speculation.drafter, speculation.draft_len
        check_speculation(drafter, k, self.engine.drafters, self.engine.config.max_draft_len)
        self.engine.check_request(prompt_ids, params)
        try:
            classification = classifier.predict(text, speculation.domain)
        except ValueError as e:
            raise RequestError(str(e).split(": ", 1)[-1], "speculation.domain") from None
        domain = classification.domain
        dp = policy.domains[domain]
        # a prediction drafter drafts only for a request that predicts its output, a grammar drafter
        # only for one with a format: their statistics are those of such requests, and no other
        # request's plan or shadows count them
        usable = {name for name in self.engine.drafters
                  if (params.prediction or name not in self.engine.prediction_drafters)
                  and (params.output_format is not None or name not in self.engine.grammar_drafters)}
        features = Features(domain, len(prompt_ids))
        if drafter == PLAIN or k == 0:
            plan = forced_plan(domain, PLAIN, 0)
        elif drafter != AUTO and k is not None:
            plan = forced_plan(domain, drafter, k)
        else:
            candidates = [d for d in dp.drafters if d == PLAIN or d in usable]
            if drafter != AUTO:  # the request names its drafter; the policy picks k
                candidates = [drafter]
            plan = self.decide(policy, features, candidates)
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
        shadow = [d for d in dp.drafters if d in usable and self.engine.drafters[d].cheap]
        gen = (self.engine.start(prompt_ids, params, domain=domain, cache_salt=cache_salt) if batch is None
               else batch.add(prompt_ids, params, domain=domain, priority=priority, cache_salt=cache_salt))
        return RoutedGeneration(self, gen, policy, classification, plan, controller, shadow,
                                candidates if plan.reason != FORCED else ())

    def decide(self, policy: Policy, features: Features, candidates: Sequence[str]) -> Plan:
        """The policy's plan for these features from the live statistics."""
        snapshot = self.store.snapshot(window_s=policy.window.seconds)  # I/O with Redis: outside the lock
        with self._lock:  # one rng, shared: draws in request order
            return decide(features, snapshot, policy, self._rng, self.costs, candidates, self.own_length)


class RoutedGeneration:
    """One request under the router: `step()` until `finished`, then `result()`; `close()` always."""

    def __init__(
        self, router: Router, gen: Generation, policy: Policy, classification: Classification, plan: Plan,
        controller: StepController, shadow: Sequence[str], candidates: Sequence[str] = (),
    ) -> None:
        """`candidates`: the drafters the plan chose among, re-planned for each context bucket
        the request enters (none: a forced plan)."""
        self.router, self.gen, self.policy = router, gen, policy
        self.classification, self.plan, self.controller = classification, plan, controller
        self.cheap, self.candidates = CheapDrafters(gen, shadow), tuple(candidates)
        self.domain = plan.domain
        self._bucket = context_bucket(gen.ctx.num_prompt)
        self._context: list[ContextSpan] = []
        self._records: list[Record] = []
        self._schedule: list[Segment] = []
        self._recorded = False

    @property
    def finished(self) -> bool:
        return self.gen.finished

    def step(self) -> StepStats:
        """One step of this request alone."""
        choice = self.choose()
        stats = self.gen.run(self.order(choice))
        self.observe(choice, stats)
        return stats

    def choose(self) -> StepChoice:
        """The controller's choice for the next step."""
        context_len = len(self.gen.ctx.token_ids)
        if (bucket := context_bucket(context_len)) != self._bucket:
            self._bucket = bucket
            if self.candidates and self.controller.adaptive:  # acceptance and costs of the new bucket
                self.controller.rebase(self.router.decide(self.policy, Features(self.domain, context_len),
                                                          self.candidates))
        return self.controller.next()

    def order(self, choice: StepChoice) -> StepOrder:
        """What the engine runs for a choice; the domain's cheap drafters are asked alongside."""
        return self.cheap.order(choice)

    def draft_option(self, choice: StepChoice) -> DraftOption | None:
        """The choice as the batch's goodput rule prices it (its cheap drafters tried first, then
        its own: one `cascade`); None where the rule has no say: a plain step, or a request that
        fixed its drafter and k."""
        tries = [(t.drafter, t.draft_len) for t in choice.first]
        if choice.drafter != PLAIN and choice.draft_len:
            tries.append((choice.drafter, choice.draft_len))
        tries = [(name, k) for name, k in tries if k]
        if not tries or not self.controller.adaptive or not all(self.controller.knows(n) for n, _ in tries):
            return None
        costs = self.controller.costs
        options = []
        for name, k in tries:
            est = self.controller.estimate(name)
            options.append(DraftOption(est.prefix, k, costs.draft_s_per_token.get(name, 0.0), est.proposes,
                                       costs.tree_sizes.get(name), est.proposed))
        return cascade(options)

    def observe(self, choice: StepChoice, stats: StepStats) -> None:
        """Account a step that ran `choice`: the controller's estimates, the records, the schedule."""
        if stats.fallback_reason is not None or stats.draft_len > 0:  # not a step clipped to k = 0 at the end
            self.controller.observe(stats.drafter, stats.num_draft_tokens, stats.num_accepted)
        self._records.append(StepRecord.from_step(self.domain, stats))
        bucket = context_bucket(stats.context_len)
        if not self._context or self._context[-1].bucket != bucket:
            self._context.append(ContextSpan(bucket))
        self._context[-1] = self._context[-1].add(stats.num_emitted, stats.num_draft_tokens, stats.num_accepted)
        for score in self.cheap.scores():
            self.controller.observe_shadow(score.drafter, score.start, score.num_proposed, score.num_accepted)
            self._records.append(ShadowRecord.from_score(self.domain, score))
        tried = {t.drafter: t.draft_len for t in choice.first}
        if stats.drafter in tried:  # a cheap drafter tried first proposed: it ran the step
            self._extend_schedule(stats.drafter, tried[stats.drafter])
        else:
            self._extend_schedule(choice.drafter, choice.draft_len)
        if self.finished:
            self._finish()
        elif len(self._records) >= FLUSH_EVERY_STEPS:
            self._flush()

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
        e2e = time.perf_counter() - self.gen.started_at
        self._records.append(RequestRecord(
            self.domain, self.plan.drafter, self.plan.reason, ttft_s=min(self.gen.ttft_s or e2e, e2e), e2e_s=e2e,
            fallbacks=self.fallbacks,
        ))
        self._flush()

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return tuple(self.controller.fallbacks)

    @property
    def may_decode_plainly(self) -> bool:
        """Whether a step may skip the controller and decode plainly (BatchFallback): not where the
        request fixed its k or its drafter, or its domain does not allow plain decoding."""
        return self.controller.adaptive and self.controller.fallback_allowed

    def report(self) -> RoutingReport:
        c = self.classification
        return RoutingReport(
            domain=self.domain, domain_source=c.source, confidence=c.confidence,
            policy_version=self.policy.version, drafter=self.plan.drafter, draft_len=self.plan.draft_len,
            reason=self.plan.reason, predicted_speedup=self.plan.predicted_speedup,
            schedule=tuple(self._schedule), fallbacks=self.fallbacks, context=tuple(self._context),
        )

    def result(self) -> GenerationResult:
        return replace(self.gen.result(), routing=self.report())

    def close(self) -> None:
        """Release the generation; an unfinished request's records are still written."""
        if not self.gen.closed:
            self.gen.close()
        if not self.finished:
            self._flush()


COST_EMA = 0.1  # weight of the latest step in the live correction of the batch cost curve
COST_FACTOR_RANGE = (0.25, 4.0)  # what one step may say of a price (draft rows, prompt rows) against the measured one
BATCH_PLAIN = StepChoice(PLAIN, 0, FALLBACK, 1.0)  # a step of a batch routing would not pay for (BatchFallback)


@dataclass
class RoutedStep:
    """One batch step under the router."""

    stats: list[tuple[RoutedGeneration, StepStats]]  # the requests that decoded
    failed: list[tuple[RoutedGeneration, Exception]]  # requests the step failed (closed by their owner)
    batch: BatchStep
    routed: bool = True  # False: decoded plainly, no controller asked (BatchFallback)
    forecast: Forecast | None = None  # what the goodput rule expected of the drafts it admitted


class RoutedBatch:
    """Continuous batching under the router: every running request advances in one target
    forward per step (workers/batch.py), each with its own drafter and k.

    Per step, each decoding request's controller picks its drafter and its best k as if alone;
    then the batch's goodput rule (policies/batching.py) lowers each k, to 0 where drafting
    does not pay, against the step's measured cost in rows. Alone, the controller's choice
    stands. Finished and failed requests leave the batch; their owner reads their result and
    closes them.

    The cost curve is one sequence's rows (`measure_batch_cost`); a batch's step costs more, by
    attention over many sequences, which its draft rows barely change (a draft row lengthens one
    of many sequences, inside its attention call's padding for a first draft token). So the
    curve is shifted, not scaled, by what steps of each batch size took beyond it: on 330
    logged steps of 5 and 16 requests drafting 0-3 tokens each (int4, docs/benchmarks.md) the
    shifted curve predicted a step within 12% on average, the scaled one within 32%, pricing a
    draft row at 2.8x its cost with 16 requests. The shift is learned from steps that verify no
    draft, and a draft row's price in a batch from the steps that do (one factor on the curve's
    price of the rows past one a request: learned into the shift, a step of 4 requests drafting
    on int4 weights made plain steps of 4 look 1.2x their time, and drafting 18% better than
    plain where it was 2-11% worse). A step with prompt rows teaches their price instead (a
    factor on their measured curve), so a prompt chunk neither skews the shift nor is mispriced."""

    def __init__(self, router: Router, batch: BatchEngine | None = None) -> None:
        self.router = router
        self.batch = batch or BatchEngine(router.engine)
        self.requests: dict[Generation, RoutedGeneration] = {}
        # the live correction of the cost curve, smoothed: per number of decoding requests, measured -
        # predicted seconds (a measured curve); measured / predicted (the unitless prior)
        self.cost_offsets: dict[int, float] = {}
        self.cost_scale = 1.0
        self.prefill_factor = 1.0  # the prompt rows' measured / priced seconds, smoothed (a measured curve)
        self.draft_row_factor = 1.0  # a draft row's measured / priced seconds in a batch, smoothed (idem)
        self.fallback = BatchFallback()  # whether routing a batch of each size pays for its host work

    @property
    def num_running(self) -> int:
        return len(self.batch.running)

    @property
    def num_waiting(self) -> int:
        return len(self.batch.waiting)

    def add(self, prompt_ids: list[int], params: SamplingParams, text: str,
            speculation: Speculation = Speculation(), priority: int = 0,
            cache_salt: str | None = None) -> RoutedGeneration:
        """Classify, plan and queue a request (`priority`: the scheduler's; `cache_salt`: the
        requests it shares cached state with). Raises RequestError for a bad request."""
        routed = self.router.start(prompt_ids, params, text, speculation, batch=self.batch, priority=priority,
                                   cache_salt=cache_salt)
        self.requests[routed.gen] = routed
        return routed

    def remove(self, routed: RoutedGeneration) -> None:
        """Take a request out (cancelled); its owner closes it."""
        self.batch.remove(routed.gen)
        self.requests.pop(routed.gen, None)

    def step(self) -> RoutedStep:
        t0 = time.perf_counter()
        decoding = self.batch.schedule()
        num_decoding = len(decoding)
        prefill_rows = self.batch.num_prefill_rows(num_decoding)
        routed = self.fallback.route(num_decoding, prefill_rows > 0)
        choices = {gen: self.requests[gen].choose() if routed or not self.requests[gen].may_decode_plainly
                   else BATCH_PLAIN for gen in decoding}
        allocated, expected = False, None
        if routed and (len(choices) > 1 or (choices and prefill_rows)):
            allocated = True
            choices, expected = self._allocate(choices, prefill_rows, self.step_cost(num_decoding))
        orders = {gen: self.requests[gen].order(choice) for gen, choice in choices.items() if choice is not BATCH_PLAIN}
        routing_s = time.perf_counter() - t0
        step = self.batch.step(orders)
        t1 = time.perf_counter()
        stats = []
        for gen, st in step.stats:
            routed_gen = self.requests[gen]
            routed_gen.observe(choices[gen], st)
            stats.append((routed_gen, st))
            if routed_gen.finished:
                del self.requests[gen]
        failed = [(self.requests.pop(gen), e) for gen, e in step.failed]
        routing_s += time.perf_counter() - t1
        if decoding and step.num_rows and step.forward_s > 0:
            self._learn_cost(num_decoding, step)
            if allocated:
                gain = 0.0 if expected is None else expected.gain
                self.fallback.observe(num_decoding, gain, routing_s / step.forward_s, prefill_rows > 0)
        return RoutedStep(stats, failed, step, routed, expected)

    def _learn_cost(self, num_decoding: int, step: BatchStep) -> None:
        """Correct the cost curve by what the step took: the unitless prior's scale; else the
        prompt rows' price factor (a step with prompt rows), the draft rows' (a step verifying
        drafts, once a shift is known) or the shift of its batch size."""
        cost = self.router.batch_cost
        prompt_rows = sum(n for _, n in step.prefilled)
        scored = step.num_rows - prompt_rows
        if not self.router.batch_cost_in_seconds:
            self.cost_scale += COST_EMA * (step.forward_s / cost.step_s(scored, prompt_rows) - self.cost_scale)
        elif prompt_rows and cost.prefill_rows:
            priced = cost.prefill_s(prompt_rows)
            factor = _clamp((step.forward_s - self.step_cost(num_decoding).step_s(scored)) / priced)
            self.prefill_factor += COST_EMA * (factor - self.prefill_factor)
        elif scored > num_decoding and self.cost_offsets and cost.step_s(scored) > cost.step_s(num_decoding):
            plain = self.step_cost(num_decoding).step_s(num_decoding)
            factor = _clamp((step.forward_s - plain) / (cost.step_s(scored) - cost.step_s(num_decoding)))
            self.draft_row_factor += COST_EMA * (factor - self.draft_row_factor)
        else:
            priced = cost.rows_scaled(num_decoding, self.draft_row_factor).step_s(scored, prompt_rows)
            excess, known = step.forward_s - priced, self.cost_offsets.get(num_decoding)
            self.cost_offsets[num_decoding] = excess if known is None else known + COST_EMA * (excess - known)

    def step_cost(self, num_decoding: int) -> BatchCost:
        """T for a step of `num_decoding` requests: the measured curve shifted by the live offset
        of that batch size, or of the nearest one seen so far, its draft rows' and prompt rows'
        prices times their live factors (the prior: scaled to seconds)."""
        cost = self.router.batch_cost
        if not self.router.batch_cost_in_seconds:
            return cost.scaled(self.cost_scale)
        if not self.cost_offsets and self.prefill_factor == 1.0 and self.draft_row_factor == 1.0:
            return cost
        nearest = min(self.cost_offsets, key=lambda n: (abs(n - num_decoding), n), default=None)
        offset = 0.0 if nearest is None else self.cost_offsets[nearest]
        return cost.shifted(offset, self.prefill_factor).rows_scaled(num_decoding, self.draft_row_factor)

    def _allocate(
        self, choices: Mapping[Generation, StepChoice], prefill_rows: int, cost: BatchCost,
    ) -> tuple[dict[Generation, StepChoice], Forecast | None]:
        """Each choice capped by the goodput rule over `cost` (choices it has no say over keep their
        rows), and what the rule expects of the capped drafts (None: it had none to price)."""
        out, priced = dict(choices), []
        fixed_rows = 0
        for gen, choice in choices.items():
            option = self.requests[gen].draft_option(choice)
            if option is not None:
                priced.append((gen, option))
            elif choice.drafter != PLAIN:
                fixed_rows += choice.draft_len  # a forced draft: its rows beyond the 1 counted below
        if not priced:
            return out, None
        options: list[DraftOption | None] = [o for _, o in priced]
        options += [None] * (len(choices) - len(priced))  # plain or fixed: one row, one token each
        ks = allocate(options, cost, fixed_rows, prefill_rows)
        for (gen, _), k in zip(priced, ks):
            out[gen] = _capped(choices[gen], k)
        return out, forecast(options, ks, cost, fixed_rows, prefill_rows)


def _clamp(factor: float) -> float:
    """What one step may say of a price against the measured one (a slow outlier, a tiny denominator)."""
    return min(max(factor, COST_FACTOR_RANGE[0]), COST_FACTOR_RANGE[1])


def _capped(choice: StepChoice, k: int) -> StepChoice:
    """A choice drafting at most k tokens (k = 0: a plain step)."""
    if k == 0:
        return StepChoice(PLAIN, 0, choice.reason, 1.0)
    return replace(choice, draft_len=min(choice.draft_len, k),
                   first=tuple(replace(t, draft_len=min(t.draft_len, k)) for t in choice.first))


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def generate(router: Router, prompt_ids: list[int], params: SamplingParams, text: str,
             speculation: Speculation = Speculation(),
             on_output: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """One routed request from start to finish (CLI, bench); `on_output` sees the output's tokens
    after each step but the last (whose output a stop string may cut: the result's)."""
    routed = router.start(prompt_ids, params, text, speculation)
    try:
        while not routed.finished:
            routed.step()
            if on_output is not None and not routed.finished:
                on_output(routed.gen.output_ids)
        return routed.result()
    finally:
        routed.close()
