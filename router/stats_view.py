"""`GET /v1/stats`: the statistics as JSON, per domain and drafter, plus the dashboard's time series.

Rates are over the policy's statistics window and over all time. The time series is the stats
store's own time buckets over the window (`StatsStore.series`): with Redis it is the same history
for every replica and ingress, and it is there as soon as the page loads (no sampling state in
the ingress).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from policies.outlook import measured_speedup
from policies.records import FINISH_REASONS, PLAIN, AcceptanceCounts, StatsSnapshot
from router.observation import Observation, finite


def arm_stats(c: AcceptanceCounts) -> dict[str, Any]:
    """One (domain, drafter)'s counters and the rates derived from them (None: nothing measured)."""
    return {
        "num_steps": c.num_steps,
        "num_drafts": c.num_drafts,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_tokens": c.num_accepted_tokens,
        "acceptance_rate": c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else None,
        "acceptance_by_position": c.acceptance_by_position(),
        # tokens per target forward, bonus included: the responses' mean_acceptance_length
        "mean_acceptance_length": c.num_emitted_tokens / c.num_steps if c.num_steps else None,
    }


def _decisions(snap: StatsSnapshot, domain: str, drafters: set[str]) -> list[dict[str, Any]]:
    return [{"drafter": r, "reason": why, "count": n} for (d, r, why), n in sorted(snap.decisions.items())
            if d == domain and r in drafters]


def _fallbacks(snap: StatsSnapshot, domain: str) -> dict[str, int]:
    return {why: n for (d, why), n in sorted(snap.fallbacks.items()) if d == domain}


def _domain(obs: Observation, domain: str) -> dict[str, Any]:
    predicted = {a.drafter: a for a in obs.outlook if a.domain == domain}
    drafters = {}
    for drafter in obs.drafters:
        arm = predicted.get(drafter)
        drafters[drafter] = {
            "window": arm_stats(obs.window.counts(domain, drafter)),
            "all_time": arm_stats(obs.all_time.counts(domain, drafter)),
            "predicted_speedup": arm.predicted_speedup if arm else None,  # None: the domain does not use it
            "predicted_draft_len": arm.draft_len if arm else None,
        }
    allowed = {*obs.drafters, PLAIN}
    return {
        "measured_speedup": {"window": obs.measured_speedup.get(domain),
                             "all_time": finite(measured_speedup(obs.all_time, domain))},
        "decisions": {"window": _decisions(obs.window, domain, allowed),
                      "all_time": _decisions(obs.all_time, domain, allowed)},
        "fallbacks": {"window": _fallbacks(obs.window, domain), "all_time": _fallbacks(obs.all_time, domain)},
        "drafters": drafters,
    }


def series(obs: Observation) -> dict[str, Any]:
    """Chart-ready columns over the store's time buckets: `start_s` is the x axis; each map holds
    one list per key aligned with it. Keys are `domain/drafter` or `domain`; only keys with data
    in the window appear, so charts stay readable."""
    points = obs.series
    pairs = [(d, r) for d in obs.domains for r in obs.drafters
             if any(p.snapshot.counts(d, r).num_steps for p in points)]
    counts = {(d, r): [p.snapshot.counts(d, r) for p in points] for d, r in pairs}
    allowed = {*obs.drafters, PLAIN}

    def decisions(p_snap: StatsSnapshot, domain: str) -> int:
        return sum(n for (d, r, _), n in p_snap.decisions.items() if d == domain and r in allowed)

    def fallbacks(p_snap: StatsSnapshot, domain: str) -> int:
        return sum(n for (d, _), n in p_snap.fallbacks.items() if d == domain)

    routed = [d for d in obs.domains if any(decisions(p.snapshot, d) for p in points)]
    fell = [d for d in obs.domains if any(fallbacks(p.snapshot, d) for p in points)]
    return {
        "bucket_s": points[0].bucket_s if points else None,
        "start_s": [p.start_s for p in points],
        "acceptance_rate": {f"{d}/{r}": [arm_stats(c)["acceptance_rate"] for c in cs] for (d, r), cs in counts.items()},
        "mean_acceptance_length": {f"{d}/{r}": [arm_stats(c)["mean_acceptance_length"] for c in cs]
                                   for (d, r), cs in counts.items()},
        "draft_tokens": {f"{d}/{r}": [c.num_draft_tokens for c in cs] for (d, r), cs in counts.items()},
        "decisions": {d: [decisions(p.snapshot, d) for p in points] for d in routed},
        "fallbacks": {d: [fallbacks(p.snapshot, d) for p in points] for d in fell},
    }


def stats_json(obs: Observation) -> dict[str, Any]:
    return {
        "replica": obs.replica,
        "policy_version": obs.policy_version,
        "window_s": obs.window_s,
        "degraded": obs.all_time.degraded or obs.window.degraded,
        "store": asdict(obs.store),
        "response_store": None if obs.response_store is None else asdict(obs.response_store),
        "background_responses": None if obs.background is None else asdict(obs.background),
        "domains": {d: _domain(obs, d) for d in obs.domains},
        "drafters": list(obs.drafters),
        "series": series(obs),
        "batching": {"num_running": obs.batching.num_running, "num_waiting": obs.batching.num_waiting,
                     "mean_batch_size": obs.batching.mean_batch_size,
                     "goodput_tokens_per_s": obs.batching.goodput,
                     "prefix_cache_hit_rate": obs.batching.prefix_hit_rate,
                     "prefix_cache_tokens": obs.batching.prefix_held_tokens,
                     "num_preemptions": obs.batching.num_preemptions,
                     "prompt_tokens": obs.batching.num_prompt_tokens,
                     "generation_tokens": obs.batching.num_emitted,
                     "kv_cache_usage": obs.batching.kv_cache_usage,
                     "finished": dict(zip(FINISH_REASONS, obs.batching.finished))},
        "suffix_caches": {name: {"tokens": dict(m.tokens), "max_tokens": m.max_tokens}
                          for name, m in obs.traffic_memory.items()},
    }
