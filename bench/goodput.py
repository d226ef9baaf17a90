"""The goodput rule's forecasts against the steps they priced: `python -m bench.goodput`.

Runs the router under closed-loop load (bench/concurrency.py) at each client count and compares,
per number of decoding requests, what the rule expected of the steps where it admitted drafts
(`Forecast`: tokens, forward seconds, the gain over the same step without drafts) with what those
steps did: tokens emitted, forward seconds, and the gain realized against the steps of that size
in the same run that drafted nothing. Steps that also ran a prompt chunk are counted apart (their
forward against the forecast only). Greedy; no output is checked here (`specroute bench
--concurrency` does). The realized gain compares steps of different moments (contexts grow), so
it is a run's figure, not a step's.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from bench.concurrency import Request, run_routed
from bench.methods import TrafficMemories
from bench.prompts import add_source_arguments, load_prompts
from bench.runner import bench_router, encode_checked
from policies.schema import load_policy
from workers.config import RoutingConfig, load_engine_config
from workers.engine import SpecEngine
from workers.routing import RoutedBatch, RoutedStep
from workers.sampling import SamplingParams


@dataclass
class SizeLog:
    """The decoding-only steps of one batch size, and how its steps with a prompt chunk were priced."""

    plain_s: list[float] = field(default_factory=list)  # forwards of steps that drafted nothing
    plain_ratios: list[float] = field(default_factory=list)  # forward / forecast, of those the rule priced
    drafted: list[tuple[RoutedStep, int]] = field(default_factory=list)  # (step, tokens emitted)
    prompt_step_ratios: list[float] = field(default_factory=list)  # forward / forecast, with a prompt chunk


def log_step(logs: dict[int, SizeLog], step: RoutedStep) -> None:
    batch, n = step.batch, len(step.stats)
    if not n or batch.forward_s <= 0:
        return
    size = logs[n]
    prompt_rows = sum(k for _, k in batch.prefilled)
    if prompt_rows:
        if step.forecast is not None:
            size.prompt_step_ratios.append(batch.forward_s / step.forecast.step_s)
    elif batch.num_rows == n:
        size.plain_s.append(batch.forward_s)
        if step.forecast is not None:
            size.plain_ratios.append(batch.forward_s / step.forecast.plain_s)
    elif step.forecast is not None:
        size.drafted.append((step, sum(st.num_emitted for _, st in step.stats)))


def report(logs: dict[int, SizeLog]) -> list[str]:
    lines = ["| decoding | plain steps | drafted steps | tokens / expected | forward / forecast | gain forecast "
             "| gain realized | plain steps: forward / forecast | prompt steps: forward / forecast |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted(logs):
        size = logs[n]
        prompt = f"{statistics.median(size.prompt_step_ratios):.2f}" if size.prompt_step_ratios else "-"
        plain = f"{statistics.median(size.plain_ratios):.2f}" if size.plain_ratios else "-"
        if not size.drafted or not size.plain_s:
            lines.append(f"| {n} | {len(size.plain_s)} | {len(size.drafted)} | | | | | {plain} | {prompt} |")
            continue
        steps = [s for s, _ in size.drafted]
        forecasts = [s.forecast for s in steps if s.forecast is not None]
        tokens = sum(t for _, t in size.drafted)
        forward = sum(s.batch.forward_s for s in steps)
        plain_rate = n * len(size.plain_s) / sum(size.plain_s)
        lines.append(
            f"| {n} | {len(size.plain_s)} | {len(steps)} | {tokens / sum(f.tokens for f in forecasts):.2f} "
            f"| {forward / sum(f.step_s for f in forecasts):.2f} | {statistics.fmean(f.gain for f in forecasts):+.3f} "
            f"| {tokens / forward / plain_rate - 1:+.3f} | {plain} | {prompt} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_source_arguments(ap)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--heldout-mod", type=int, default=5)
    ap.add_argument("--concurrency", default="4,16", help="client counts, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = SpecEngine.from_config(load_engine_config(args.config))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = load_prompts(args.prompts, args.per_category, None, args.heldout_mod)
    ids = encode_checked(engine, prompts, params)
    requests = [Request(p, ids[p.question_id]) for p in prompts]
    routing = RoutingConfig()
    router = bench_router(engine, load_policy(routing.policy_path()), routing, batched=True)
    memories = TrafficMemories(engine)  # each level learns from its own requests only (bench/methods.py)
    with memories.of("warm-up"):
        run_routed(RoutedBatch(router), requests[:2], params, 2)
    print(f"{engine.target.name} on {engine.target.model.device}, {torch.get_num_threads()} threads; "
          f"{len(requests)} prompts, at most {args.max_tokens} new tokens")
    for c in (int(x) for x in args.concurrency.split(",")):
        logs: dict[int, SizeLog] = defaultdict(SizeLog)
        memories.reset()
        with memories.of("router"):
            run_routed(RoutedBatch(router), requests, params, c, on_step=functools.partial(log_step, logs))
        print(f"\n{c} clients\n", *report(logs), sep="\n", flush=True)


if __name__ == "__main__":
    main()
