"""Per-category and overall summaries of run records: speedup, MAT, tokens/s, losslessness."""

from __future__ import annotations

from collections.abc import Sequence

from bench.records import MethodSummary, RunRecord

PLAIN_METHOD = "plain"
OVERALL = "overall"


def summarize_group(records: Sequence[RunRecord], method: str) -> MethodSummary:
    """One method over one group of prompts; plain's records of the same prompts are the baseline."""
    plain = {r.question_id: r for r in records if r.method == PLAIN_METHOD}
    runs = [r for r in records if r.method == method and r.question_id in plain]
    wall_s = sum(r.wall_s for r in runs)
    plain_wall_s = sum(plain[r.question_id].wall_s for r in runs)
    num_new = sum(r.num_new_tokens for r in runs)
    steps = [r.num_steps for r in runs]
    num_steps = sum(s for s in steps if s is not None)
    return MethodSummary(
        speedup=plain_wall_s / wall_s if wall_s > 0 else None,
        mat=num_new / num_steps if runs and None not in steps and num_steps > 0 else None,
        tokens_per_s=num_new / wall_s if wall_s > 0 else None,
        lossless=all(r.token_ids == plain[r.question_id].token_ids for r in runs),
    )


def summarize(records: Sequence[RunRecord]) -> dict[str, dict[str, MethodSummary]]:
    """{category (in order of appearance), then OVERALL: {method: MethodSummary}}."""
    methods = list(dict.fromkeys(r.method for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    groups = {c: [r for r in records if r.category == c] for c in categories}
    groups[OVERALL] = list(records)
    return {name: {m: summarize_group(group, m) for m in methods} for name, group in groups.items()}
