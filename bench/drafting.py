"""Drafting in batch against drafting request by request: `python -m bench.drafting`.

Continuous batching asks a batch drafter (the small model, EAGLE, Medusa) once per step for every
request that uses it (`propose_batch`); before, each request proposed alone. This times both side
by side in one process, on the same requests at the same positions: B held-out Spec-Bench prompts
are prefilled and decoded a few plain steps; then, round after round, every request's draft is
proposed both ways (each from a state of its own), the requests advance one plain token (a
rejected draft: the drafters catch up one token next round), and the drafters are told so.
Reported: the drafting milliseconds per step for the whole batch, alone and batched.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.prompts import add_source_arguments, load_prompts
from workers.config import load_engine_config
from workers.drafters.base import BatchDrafter, DraftRequest
from workers.engine import SpecEngine
from workers.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_source_arguments(ap)
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per request and step")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    engine = SpecEngine.from_config(load_engine_config(args.config))
    drafters = {name: d for name, d in engine.drafters.items() if isinstance(d, BatchDrafter)}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = load_prompts(args.prompts, 2, None, 5)
    params = SamplingParams(max_tokens=args.rounds + 16, ignore_eos=True)
    rows = []
    for b in sizes:
        gens = [engine.start(engine.encode(p.text), params) for p in (prompts * b)[:b]]
        for gen in gens:
            for _ in range(4):
                gen.step()
        for name, drafter in drafters.items():
            batched = [drafter.begin(g.ctx) for g in gens]  # first: the model drafter's pool slots
            alone = [drafter.begin(g.ctx) for g in gens]
            for g, s, t in zip(gens, alone, batched):  # the first proposal catches up on the prompt: untimed
                drafter.propose(s, g.ctx, args.k)
                drafter.propose(t, g.ctx, args.k)
            t_alone = t_batched = 0.0
            for r in range(args.rounds + 1):
                for g, s, t in zip(gens, alone, batched):
                    g.step()  # one plain token: the drafts were rejected
                    drafter.commit(s, g.ctx, 1, 0)
                    drafter.commit(t, g.ctx, 1, 0)
                t0 = time.perf_counter()
                for g, s in zip(gens, alone):
                    drafter.propose(s, g.ctx, args.k)
                t1 = time.perf_counter()
                drafter.propose_batch([DraftRequest(t, g.ctx, args.k) for g, t in zip(gens, batched)])
                t2 = time.perf_counter()
                if r:  # the first round warms up
                    t_alone, t_batched = t_alone + t1 - t0, t_batched + t2 - t1
            for s in alone + batched:
                drafter.end(s)
            rows.append((name, b, t_alone / args.rounds * 1e3, t_batched / args.rounds * 1e3))
            for g in gens:  # the same positions for the next drafter
                g.ctx.token_ids, g.finish_reason = g.ctx.token_ids[: -(args.rounds + 1)], None
                g.cache.truncate(len(g.ctx.token_ids) - 1)
        for g in gens:
            g.close()
    print(f"k = {args.k}, {args.rounds} rounds, torch threads {torch.get_num_threads()}, config {args.config}\n")
    print("| drafter | requests | alone ms / step | batched ms / step | batched / alone |")
    print("|---|---:|---:|---:|---:|")
    for name, b, a, t in rows:
        print(f"| {name} | {b} | {a:.2f} | {t:.2f} | {t / a:.2f} |")


if __name__ == "__main__":
    main()
