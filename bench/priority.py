"""Priority scheduling under load: `python -m bench.priority`.

Background clients (priority 1) keep every KV slot busy with long answers while a foreground
client (priority 0) asks short questions one after another, `--foreground-gap` seconds after
each answer (a user reading it; meanwhile a background request takes the slot), plain decoding. The same
workload runs with `scheduler.policy` fcfs and priority on one engine, alternately; the run ends
when the last foreground answer is out. Reported per policy: the foreground's TTFT and latency
(p50 / p90), the background's tokens/s, the preemptions, and whether every answer equals the
other policy's (greedy, on a target where a row's result does not depend on its batch).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.concurrency import percentile
from bench.prompts import add_source_arguments, load_prompts
from bench.report import publish
from workers.batch import BatchEngine
from workers.config import load_engine_config
from workers.engine import Generation, SpecEngine, StepOrder
from workers.sampling import SamplingParams

POLICIES = ("fcfs", "priority")


@dataclass
class PolicyRun:
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  # the foreground's
    latency_s: list[float] = field(default_factory=list)  # the foreground's, send to last token
    num_background_tokens: int = 0
    num_preemptions: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # "fg/i" or "bg/i" -> output ids, finished ones


def run_policy(engine: SpecEngine, policy: str, background: Sequence[list[int]], foreground: Sequence[list[int]],
               num_background: int, background_params: SamplingParams, foreground_params: SamplingParams,
               gap_s: float) -> PolicyRun:
    """One pass: `num_background` clients send `background` prompts in turn, one client sends
    `foreground` prompts, each `gap_s` after the last answer (priority 0 against 1 under the
    priority policy)."""
    batch = BatchEngine(engine.with_scheduler(policy=policy))
    run = PolicyRun()
    queues = {"bg": deque(enumerate(background)), "fg": deque(enumerate(foreground))}
    active: dict[Generation, tuple[str, int, float]] = {}  # -> (kind, index, sent)
    first: dict[Generation, float] = {}

    def send(kind: str) -> None:
        if not queues[kind]:
            return
        i, ids = queues[kind].popleft()
        params, priority = (foreground_params, 0) if kind == "fg" else (background_params, int(policy == "priority"))
        active[batch.add(ids, params, priority=priority)] = (kind, i, time.perf_counter())

    t0 = time.perf_counter()
    for _ in range(num_background):
        send("bg")
    next_fg: float | None = t0 + gap_s  # when the foreground sends its next question
    while next_fg is not None or any(kind == "fg" for kind, _, _ in active.values()):
        if next_fg is not None and time.perf_counter() >= next_fg:
            send("fg")
            next_fg = None
        step = batch.step({g: StepOrder() for g in batch.schedule()})
        now = time.perf_counter()
        for gen, st in step.stats:
            kind, i, sent = active[gen]
            if st.num_emitted:
                first.setdefault(gen, now)
            if kind == "bg":
                run.num_background_tokens += st.num_emitted
            if not gen.finished:
                continue
            del active[gen]
            run.outputs[f"{kind}/{i}"] = gen.output_ids
            gen.close()
            if kind == "bg":
                send(kind)
                continue
            run.ttft_s.append(first[gen] - sent)
            run.latency_s.append(now - sent)
            if queues["fg"]:
                next_fg = now + gap_s
    run.wall_s = time.perf_counter() - t0
    run.num_preemptions = batch.num_preemptions
    for gen in active:  # the background still running
        batch.remove(gen)
        gen.close()
    return run


def compare(engine: SpecEngine, background: Sequence[list[int]], foreground: Sequence[list[int]],
            num_background: int, background_params: SamplingParams, foreground_params: SamplingParams,
            gap_s: float, rounds: int) -> dict[str, Any]:
    """Each policy `rounds` times, alternately; per policy the round with the lowest foreground
    TTFT p50, and whether every answer finished under both policies is the same."""
    runs: dict[str, list[PolicyRun]] = {p: [] for p in POLICIES}
    for r in range(rounds):
        for policy in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
            runs[policy].append(run_policy(engine, policy, background, foreground, num_background,
                                           background_params, foreground_params, gap_s))
    outputs = [run.outputs for rs in runs.values() for run in rs]
    shared = set.intersection(*(set(o) for o in outputs))
    num_mismatches = sum(len({tuple(o[key]) for o in outputs}) > 1 for key in shared)
    out: dict[str, Any] = {"num_compared": len(shared), "num_mismatches": num_mismatches}
    for policy, rs in runs.items():
        best = min(rs, key=lambda x: percentile(x.ttft_s, 50))
        out[policy] = {
            "ttft_p50_s": percentile(best.ttft_s, 50), "ttft_p90_s": percentile(best.ttft_s, 90),
            "latency_p50_s": percentile(best.latency_s, 50), "latency_p90_s": percentile(best.latency_s, 90),
            "background_tokens_per_s": best.num_background_tokens / best.wall_s,
            "num_preemptions": best.num_preemptions,
            "ttft_p50_s_rounds": [percentile(x.ttft_s, 50) for x in rs],
        }
    return out


def report(results: dict[str, Any]) -> str:
    lines = ["| policy | foreground TTFT p50 s | p90 s | foreground latency p50 s | p90 s | background tokens/s "
             "| preemptions |", "|---|---:|---:|---:|---:|---:|---:|"]
    for policy in POLICIES:
        r = results[policy]
        lines.append(f"| {policy} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['latency_p50_s']:.3f} | "
                     f"{r['latency_p90_s']:.3f} | {r['background_tokens_per_s']:.1f} | {r['num_preemptions']} |")
    lines.append(f"\nanswers equal under both policies: {results['num_compared'] - results['num_mismatches']}"
                 f"/{results['num_compared']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_source_arguments(ap)
    ap.add_argument("--max-num-seqs", type=int, default=4, help="KV slots (scheduler.max_num_seqs)")
    ap.add_argument("--background", type=int, default=6, help="background clients")
    ap.add_argument("--foreground", type=int, default=12, help="foreground questions")
    ap.add_argument("--background-tokens", type=int, default=128)
    ap.add_argument("--foreground-tokens", type=int, default=32)
    ap.add_argument("--foreground-gap", type=float, default=0.5, help="seconds between an answer and the next question")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results.json here")
    args = ap.parse_args()
    config = load_engine_config(args.config)
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"max_num_seqs": args.max_num_seqs})})
    engine = SpecEngine.from_config(config)
    writing = load_prompts(args.prompts, sys.maxsize, ["writing"])  # every one
    background = [engine.encode(p.text) for p in writing * 4]  # enough to keep the clients busy
    foreground = [engine.encode(p.text) for p in load_prompts(args.prompts, args.foreground, ["qa"])]
    bg_params = SamplingParams(max_tokens=args.background_tokens, ignore_eos=True)
    fg_params = SamplingParams(max_tokens=args.foreground_tokens)
    compare(engine, background[:4], foreground[:2], args.max_num_seqs, bg_params, fg_params, 0.0, 1)  # warm-up
    results = compare(engine, background, foreground, args.background, bg_params, fg_params, args.foreground_gap,
                      args.rounds)
    results.update({"config": str(args.config), "threads": torch.get_num_threads(),
                    "max_num_seqs": args.max_num_seqs, "background_clients": args.background,
                    "foreground_gap_s": args.foreground_gap})
    publish(report(results), results, args.out)


if __name__ == "__main__":
    main()
