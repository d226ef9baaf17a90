"""What a replica logs for its operators, as vLLM does. Its periodic stats lines: every
`log_stats_interval_s` while it serves, the interval's prompt and generation throughput, the
queues, the KV cache and the prefix cache, then its speculation: acceptance (mean length, rate,
per position) and the drafters its steps used. With `log_requests`, a line per request received
and per request finished (its routing, acceptance and times).

    Avg prompt throughput: 310.2 tokens/s, Avg generation throughput: 41.7 tokens/s, Running: 3 reqs,
    Waiting: 0 reqs, KV cache usage: 4.1%, Prefix cache hit rate: 62.0%
    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted: 124 tokens, Drafted: 301 tokens,
    Per-position acceptance rate: 0.712, 0.402, 0.199, Avg Draft acceptance rate: 41.2%,
    Steps by drafter: suffix 52%, ngram 30%, none 18%

The counts come from the replica's own steps (the Prometheus totals, from the shared store, are
the application's).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.records import BatchingStats
from workers.result import GenerationResult, StepStats


@dataclass
class SpecCounts:
    """The speculation of an interval's steps, request by request."""

    steps_by_drafter: Counter[str] = field(default_factory=Counter)
    num_drafts: int = 0  # steps that proposed a token
    num_draft_tokens: int = 0
    num_accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, step: StepStats) -> None:
        self.steps_by_drafter[step.drafter] += 1
        k = step.num_draft_tokens
        if not k:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted += step.num_accepted
        for counts, n in ((self.drafted_per_pos, k), (self.accepted_per_pos, step.num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1


def stats_lines(before: BatchingStats, now: BatchingStats, spec: SpecCounts, seconds: float) -> list[str]:
    """The lines for an interval of `seconds` from `before` to `now` (the replica's batching stats)."""
    queried, hits = now.prefix_queries - before.prefix_queries, now.prefix_hits - before.prefix_hits
    usage = now.kv_cache_usage
    lines = [
        f"Avg prompt throughput: {(now.num_prompt_tokens - before.num_prompt_tokens) / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {(now.num_emitted - before.num_emitted) / seconds:.1f} tokens/s, "
        f"Running: {now.num_running} reqs, Waiting: {now.num_waiting} reqs, "
        f"KV cache usage: {'-' if usage is None else f'{100 * usage:.1f}%'}, "
        f"Prefix cache hit rate: {'-' if not queried else f'{100 * hits / queried:.1f}%'}"
    ]
    num_steps = sum(spec.steps_by_drafter.values())
    if not num_steps:
        return lines
    drafters = ", ".join(f"{name} {_percent(n / num_steps)}" for name, n in spec.steps_by_drafter.most_common())
    if not spec.num_drafts:
        lines.append(f"SpecDecoding metrics: no drafts, Steps by drafter: {drafters}")
        return lines
    accepted = spec.accepted_per_pos + [0] * (len(spec.drafted_per_pos) - len(spec.accepted_per_pos))
    per_pos = ", ".join(f"{a / d:.3f}" for a, d in zip(accepted, spec.drafted_per_pos))
    lines.append(
        f"SpecDecoding metrics: Mean acceptance length: {1 + spec.num_accepted / spec.num_drafts:.2f}, "
        f"Accepted: {spec.num_accepted} tokens, Drafted: {spec.num_draft_tokens} tokens, "
        f"Per-position acceptance rate: {per_pos}, "
        f"Avg Draft acceptance rate: {100 * spec.num_accepted / spec.num_draft_tokens:.1f}%, "
        f"Steps by drafter: {drafters}"
    )
    return lines


def _percent(share: float) -> str:
    return "<1%" if 0 < share < 0.005 else f"{100 * share:.0f}%"


class StatsLogger:
    """Collects a replica's steps and hands out an interval's lines once it is over: every
    `interval_s` while the replica steps (the last interval's too, once it is over, however idle
    the replica is by then); an interval starts at the first step after the last lines' interval."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._since_s = 0.0
        self._before = BatchingStats()
        self._spec = SpecCounts()
        self._stepped = False  # a step since the last lines

    def step(self, stats: Iterable[StepStats], now_s: float, batching: Callable[[], BatchingStats]) -> None:
        """A step's requests, the step starting at `now_s`; `batching()`: the replica's stats before it."""
        if not self._stepped:
            self._stepped = True
            if now_s >= self._since_s + self.interval_s:  # the last interval is over: this one starts here
                self._since_s, self._before = now_s, batching()
        for step in stats:
            self._spec.add(step)

    def due_in(self, now_s: float) -> float | None:
        """Seconds until the current interval's lines are due; None: nothing to report."""
        if not self._stepped:
            return None
        return max(0.0, self._since_s + self.interval_s - now_s)

    def lines(self, batching: Callable[[], BatchingStats], now_s: float) -> list[str]:
        """The lines of the interval ending now, and a new one started, where they are due; else
        none. `batching()`: the replica's stats now, read only then."""
        if self.due_in(now_s) != 0.0:
            return []
        now = batching()
        out = stats_lines(self._before, now, self._spec, now_s - self._since_s)
        self._since_s, self._before, self._spec, self._stepped = now_s, now, SpecCounts(), False
        return out


def received_line(prompt: str | list[dict[str, Any]], params: Mapping[str, Any], max_log_len: int | None) -> str:
    """A request as it arrived: its prompt (a chat as JSON; the first `max_log_len` characters) and
    the parameters it set."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    if max_log_len is not None and len(text) > max_log_len:
        text = text[:max_log_len] + f"... ({len(text)} characters)"
    settings = ", ".join(f"{name}={value!r}" for name, value in params.items())
    return f"Received request: prompt: {text!r}, params: {{{settings}}}"


def finished_line(result: GenerationResult) -> str:
    """A finished request: why it ended, its tokens, how it was routed and drafted, its times."""
    r = result.routing
    route = "" if r is None else f", domain {r.domain}, plan {r.drafter} ({r.reason})"
    drafters = ", ".join(result.drafters) or "none"
    return (f"Finished request: {result.finish_reason}, {len(result.prompt_token_ids)} prompt tokens "
            f"({result.num_cached_tokens} cached), {len(result.token_ids)} output tokens in {result.num_steps} "
            f"steps (mean acceptance length {result.mean_acceptance_length:.2f}; drafters {drafters}{route}), "
            f"TTFT {result.ttft_s:.3f} s, total {result.wall_s:.3f} s")
