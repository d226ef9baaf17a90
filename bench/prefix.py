"""Prefix caching under chat traffic: `python -m bench.prefix`.

Two workloads, each run on one engine with prefix caching on and off, alternately (on, off, then
off, on), closed loop with `--concurrency` clients:
  conversations  Spec-Bench's two-turn questions (MT-bench): a client sends a conversation's first
                 turn, its second ([question 1, answer 1, question 2]) once the first is answered,
                 then its next conversation;
  system         one long system prompt (a Spec-Bench summarization article as the reference the
                 assistant answers from, cut to `--system-tokens`) ahead of single-turn questions.
Per workload, method and mode: tokens/s, TTFT p50 / p90 (the second turns only, for
conversations), the prompt tokens prefilled and those found cached; and whether every output
equals the other mode's (greedy, on a target where reuse is exact).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.concurrency import percentile
from bench.prompts import add_source_arguments
from bench.report import publish
from bench.runner import bench_router
from policies.schema import load_policy
from workers.batch import BatchEngine
from workers.config import RoutingConfig, load_engine_config
from workers.engine import Generation, SpecEngine, StepOrder
from workers.routing import RoutedBatch, Router
from workers.sampling import SamplingParams

MODES = ("on", "off")


@dataclass(frozen=True)
class Conversation:
    turns: tuple[str, ...]  # the user's messages, one a turn
    system: str | None = None


@dataclass
class ModeRun:
    """One pass over a workload."""

    wall_s: float = 0.0
    num_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # of the turns measured
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # "conversation/turn" -> output ids

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


@dataclass(frozen=True)
class _Driver:
    """How a method runs requests on a batch: send one, step all (-> (handle, tokens emitted)),
    and each handle's generation."""

    send: Callable[[list[int], str], Any]
    step: Callable[[], list[tuple[Any, int]]]
    gen: Callable[[Any], Generation]


def _plain(batch: BatchEngine, params: SamplingParams) -> _Driver:
    def step() -> list[tuple[Any, int]]:
        done = batch.step({g: StepOrder() for g in batch.schedule()})
        return [(g, st.num_emitted) for g, st in done.stats]

    return _Driver(lambda ids, _text: batch.add(ids, params), step, lambda g: g)


def _routed(batch: RoutedBatch, params: SamplingParams) -> _Driver:
    def step() -> list[tuple[Any, int]]:
        return [(r, st.num_emitted) for r, st in batch.step().stats]

    return _Driver(lambda ids, text: batch.add(ids, params, text), step, lambda r: r.gen)


def run_conversations(engine: SpecEngine, driver: _Driver, conversations: Sequence[Conversation],
                      concurrency: int, measured_turn: int | None) -> ModeRun:
    """The closed loop: each client runs a conversation turn by turn. `measured_turn`: the turn
    whose TTFT is reported (None: every turn)."""
    run = ModeRun()
    queue = deque(range(len(conversations)))
    answers: dict[int, list[str]] = {i: [] for i in range(len(conversations))}
    active: dict[Any, tuple[int, int, float]] = {}  # handle -> (conversation, turn, sent)
    first: dict[Any, float] = {}

    def send(i: int) -> None:
        conv, turn = conversations[i], len(answers[i])
        messages = [{"role": "system", "content": conv.system}] if conv.system is not None else []
        for j in range(turn + 1):
            messages.append({"role": "user", "content": conv.turns[j]})
            if j < turn:
                messages.append({"role": "assistant", "content": answers[i][j]})
        ids = engine.encode(messages)
        active[driver.send(ids, conv.turns[turn])] = (i, turn, time.perf_counter())
        run.num_prompt_tokens += len(ids)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        send(queue.popleft())
    while active:
        emitted = driver.step()
        now = time.perf_counter()
        for handle, n in emitted:
            run.num_tokens += n
            if n:
                first.setdefault(handle, now)
            gen = driver.gen(handle)
            if not gen.finished:
                continue
            i, turn, sent = active.pop(handle)
            if measured_turn is None or turn == measured_turn:
                run.ttft_s.append(first[handle] - sent)
            run.outputs[f"{i}/{turn}"] = gen.output_ids
            run.num_cached_tokens += gen.num_cached
            answers[i].append(engine.target.tokenizer.decode(gen.output_ids, skip_special_tokens=True))
            gen.close()
            if len(answers[i]) < len(conversations[i].turns):
                send(i)
            elif queue:
                send(queue.popleft())
    run.wall_s = time.perf_counter() - t0
    return run


def workloads(prompts_path: Path, num: int, system_tokens: int, engine: SpecEngine) -> dict[str, list[Conversation]]:
    questions = [json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()]
    two_turn = [q for q in questions if len(q["turns"]) >= 2]
    conversations = [Conversation(tuple(q["turns"][:2])) for q in two_turn[:num]]
    article = next(q for q in questions if q["category"] == "summarization")["turns"][0]
    ids = engine.target.tokenizer.encode(article, add_special_tokens=False)[:system_tokens]
    system = ("You answer questions in two or three sentences. Where it helps, use this reference:\n\n"
              + engine.target.tokenizer.decode(ids))
    qa = [q["turns"][0] for q in questions if q["category"] == "qa"][:num]
    return {"conversations": conversations, "system": [Conversation((q,), system) for q in qa]}


def compare(engine: SpecEngine, router: Router | None, methods: Sequence[str], name: str,
            conversations: Sequence[Conversation], params: SamplingParams, concurrency: int,
            rounds: int) -> dict[str, Any]:
    """Each method with prefix caching on and off, alternately, `rounds` times; the fastest run
    of each reported, every run's outputs compared with the first run's."""
    measured = 1 if name == "conversations" else None
    out: dict[str, Any] = {}
    for method in methods:
        runs: dict[str, list[ModeRun]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                if method == "router":
                    assert router is not None
                    routed = RoutedBatch(router)
                    batch, driver = routed.batch, _routed(routed, params)
                else:
                    batch = BatchEngine(engine)
                    driver = _plain(batch, params)
                if mode == "off":
                    batch.prefix = None
                elif batch.prefix is None:
                    raise SystemExit("prefix caching is off for this target (enable_prefix_caching in the config)")
                runs[mode].append(run_conversations(engine, driver, conversations, concurrency, measured))
        reference = runs["on"][0].outputs
        out[method] = {mode: _summary(rs, reference) for mode, rs in runs.items()}
        on, off = (max(runs[m], key=lambda x: x.tokens_per_s) for m in MODES)
        out[method]["speedup"] = on.tokens_per_s / off.tokens_per_s
        out[method]["ttft_p50_ratio"] = percentile(off.ttft_s, 50) / percentile(on.ttft_s, 50)
    return out


def _summary(runs: list[ModeRun], reference: dict[str, list[int]]) -> dict[str, Any]:
    best = max(runs, key=lambda r: r.tokens_per_s)
    return {
        "tokens_per_s": best.tokens_per_s, "tokens_per_s_rounds": [r.tokens_per_s for r in runs],
        "ttft_p50_s": percentile(best.ttft_s, 50), "ttft_p90_s": percentile(best.ttft_s, 90),
        "prompt_tokens": best.num_prompt_tokens, "cached_tokens": best.num_cached_tokens,
        "num_mismatches": max(sum(r.outputs[k] != v for k, v in reference.items()) for r in runs),
        "num_requests": len(reference),
    }


def report(results: dict[str, Any]) -> str:
    lines = ["| workload | clients | method | prefix caching | tokens/s | TTFT p50 s | TTFT p90 s | prompt tokens "
             "| cached | outputs = other mode |", "|---|---:|---|---|---:|---:|---:|---:|---:|:---:|"]
    for key, by_method in results["runs"].items():
        name, clients = key.rsplit("@", 1)
        for method, r in by_method.items():
            for mode in MODES:
                m = r[mode]
                lines.append(f"| {name} | {clients} | {method} | {mode} | {m['tokens_per_s']:.1f} | "
                             f"{m['ttft_p50_s']:.3f} | {m['ttft_p90_s']:.3f} | {m['prompt_tokens']} | "
                             f"{m['cached_tokens']} | {m['num_requests'] - m['num_mismatches']}/{m['num_requests']} |")
            lines.append(f"| {name} | {clients} | {method} | on / off | {r['speedup']:.2f}x | "
                         f"{r['ttft_p50_ratio']:.2f}x faster | | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_source_arguments(ap)
    ap.add_argument("--num", type=int, default=16, help="conversations (and system-prompt questions)")
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--methods", default="plain,router")
    ap.add_argument("--workloads", default="conversations,system")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results.json here")
    args = ap.parse_args()
    config = load_engine_config(args.config)
    engine = SpecEngine.from_config(config)
    methods = args.methods.split(",")
    router = None
    if "router" in methods:
        routing = RoutingConfig()
        router = bench_router(engine, load_policy(routing.policy_path()), routing, batched=True)
    params = SamplingParams(max_tokens=args.max_tokens)
    loads = workloads(args.prompts, args.num, args.system_tokens, engine)
    warm = {name: convs[:2] for name, convs in loads.items()}
    for name in args.workloads.split(","):  # unmeasured: the kernels' and the router's first calls
        compare(engine, router, methods, name, warm[name], params, 2, 1)
    results: dict[str, Any] = {"config": str(args.config), "threads": torch.get_num_threads(),
                               "max_tokens": args.max_tokens, "runs": {}}
    for name in args.workloads.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            results["runs"][f"{name}@{c}"] = compare(engine, router, methods, name, loads[name], params, c,
                                                     args.rounds)
    publish(report(results), results, args.out)


if __name__ == "__main__":
    main()
