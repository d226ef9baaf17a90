"""One batched target forward, timed on replayed batches: `python -m bench.batch_forward`.

A pool of 16 slots holds contexts as long as held-out Spec-Bench prompts plus part of a 128-token
answer (random keys and values: attention's cost does not depend on them); each composition then
runs `forward_batch` over some of those sequences, every one decoding or verifying k drafts, and
the median of `--repeats` forwards is reported. What a change to the batched forward does, apart
from the scheduler, the drafters and the router around it: run it in the checkout before and after,
alternately (the closed-loop figures are `specroute bench --concurrency`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.prompts import add_source_arguments, load_prompts
from workers.config import load_engine_config
from workers.engine import SpecEngine
from workers.models.base import BatchedLM, SeqInput
from workers.models.llama import StaticKVCache

NUM_SLOTS = 16
ANSWER_TOKENS = 128


@dataclass(frozen=True)
class Composition:
    name: str
    drafts: tuple[int, ...]  # per sequence (the first len(drafts) slots): 0 decodes, k verifies k drafts


def compositions(rng: random.Random) -> list[Composition]:
    return [
        Composition("16 decoding", (0,) * 16),
        Composition("16, drafts of 0-3 at random", tuple(rng.choice((0, 0, 1, 2, 3)) for _ in range(16))),
        Composition("16, one verifying 8", (0,) * 7 + (8,) + (0,) * 8),
        Composition("8 decoding", (0,) * 8),
        Composition("8, drafts of 0, 1 or 3", tuple(rng.choice((0, 1, 3)) for _ in range(8))),
        Composition("4 decoding", (0,) * 4),
        Composition("4 verifying 3", (3,) * 4),
    ]


def _time_forward(model: BatchedLM, caches: Sequence[StaticKVCache], drafts: Sequence[int], vocab: int) -> float:
    batch = [SeqInput(torch.randint(0, vocab, (1 + k,)), c, "all") for c, k in zip(caches, drafts)]
    t0 = time.perf_counter()
    model.forward_batch(batch)
    elapsed = time.perf_counter() - t0
    for c, k in zip(caches, drafts):
        c.truncate(c.length - 1 - k)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_source_arguments(ap)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = SpecEngine.from_config(load_engine_config(args.config))
    model = engine.target.model
    if not isinstance(model, BatchedLM):
        raise SystemExit(f"{engine.target.name} has no batched forward (backend 'fast' has)")
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    lengths = [len(engine.encode(p.chat())) for p in load_prompts(args.prompts, 3, None, 5)]
    pool = model.new_pool(NUM_SLOTS, max(lengths) + ANSWER_TOKENS + 16)
    caches: list[StaticKVCache] = []
    for _ in range(NUM_SLOTS):
        cache = pool.allocate()
        assert isinstance(cache, StaticKVCache)  # FastLlama's pool
        n = rng.choice(lengths) + rng.randrange(ANSWER_TOKENS)
        cache.k[:, :, :n] = torch.randn_like(cache.k[:, :, :n])
        cache.v[:, :, :n] = torch.randn_like(cache.v[:, :, :n])
        cache.extend(n)
        caches.append(cache)
    vocab = model.info.vocab_size
    print(f"{engine.target.name}, contexts {[c.length for c in caches]}; median of {args.repeats} forwards\n")
    print("| batch | rows | forward ms |")
    print("|---|---:|---:|")
    for comp in compositions(rng):
        members = caches[: len(comp.drafts)]
        for _ in range(2):
            _time_forward(model, members, comp.drafts, vocab)
        times = [_time_forward(model, members, comp.drafts, vocab) for _ in range(args.repeats)]
        print(f"| {comp.name} | {len(comp.drafts) + sum(comp.drafts)} | {1e3 * statistics.median(times):.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
