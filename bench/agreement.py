"""Teacher-forced agreement of trained drafters with the target, on the target's own greedy answers.

A greedy k = 1 chain accepts its draft exactly when the drafter's argmax after the target's newest
(bonus) token is the target's next token. Teacher forcing asks that at every position of the
target's greedy answer in one forward per drafter, so it measures what limits every chain and tree
(the first draft position) per domain in minutes, with no speculative decoding run; top-4
and top-10 bound what a tree's first level (topk 4 or 10) can accept. Splitting by the target's own
confidence separates "the target's choice is a near tie" from "the drafter does not know":

    python -m bench.agreement --config bench/trained_drafters.yaml --drafters eagle1,medusa1,distilled1 \\
        --prompts ../shared/data/spec_bench/question.jsonl --per-category 2 [--split train]

`--split heldout` (default) takes Spec-Bench's held-out questions (question_id % 5 == 0), `train`
the others: the train split's greedy answers are in the shipped drafters' corpora, so the gap
between the two is how much a drafter recalls rather than generalises.

`--temperature T` asks the same of sampled answers (prompt i sampled at T with seed i), where a
draft is accepted by chance: per position, what rejection sampling accepts of a draw from the
drafter's q (sum min(p, q)), what exact match on keyed draws accepts of its likeliest token
(p(argmax q)), and how often a race of q, and of q ** RACE_POWER, on `--seeds` seeds' keyed draws
picks the target's own draw there (workers/sampling.py PositionDraws, workers/drafters/base.py
draft_tokens).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.prompts import BenchPrompt, load_prompts
from policies.classifier import CATEGORY_TO_DOMAIN
from training.corpus import HELDOUT_MOD
from workers.drafters.base import RACE_POWER, Drafter, full_vocab_probs, token_ids_of
from workers.drafters.eagle import EagleDrafter
from workers.drafters.medusa import MedusaDrafter
from workers.drafters.model import ModelDrafter
from workers.engine import SpecEngine
from workers.sampling import PositionDraws, SamplingParams, probs_from_logits

SUPPORTED = (EagleDrafter, MedusaDrafter, ModelDrafter)  # the kinds with a model to teacher force
CONFIDENT = 0.8  # the target's top probability above which a position counts as confident
TOP_K = (1, 4, 10)


@dataclass
class Agreement:
    """Counts over answer positions: how often the target's token is among the drafter's top-k."""

    positions: int = 0
    hits: dict[int, int] = field(default_factory=lambda: dict.fromkeys(TOP_K, 0))
    confident: int = 0  # positions where the target's top probability exceeds CONFIDENT
    confident_hits: int = 0  # top-1 hits among them

    def rate(self, k: int) -> float:
        return self.hits[k] / self.positions if self.positions else 0.0

    def add(self, hits: torch.Tensor, confident: torch.Tensor) -> None:
        """hits [n, len(TOP_K)] bool, confident [n] bool."""
        self.positions += hits.shape[0]
        for i, k in enumerate(TOP_K):
            self.hits[k] += int(hits[:, i].sum())
        self.confident += int(confident.sum())
        self.confident_hits += int(hits[confident, 0].sum())


def next_next_logits(drafter: Drafter, ids: torch.Tensor,
                     features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [L - 1, draft vocab] whose row t scores token t + 2 from what a chain's first draft
    sees there: the tokens through t + 1 and the target's features through t; and the token id of
    each column (None: the columns are token ids)."""
    if isinstance(drafter, EagleDrafter):  # (f_t, x_t+1) -> f_t+1, through the head
        n = ids.shape[0] - 1
        out = drafter.net(drafter.embed[ids[1:]][None], features[:-1][None], drafter.cos[:n], drafter.sin[:n])[0]
        return out @ drafter.head_t, drafter.vocab_ids
    if isinstance(drafter, MedusaDrafter):  # head 0 on f_t guesses token t + 2
        out = drafter.heads(features[:-1])[0]
        return (out if drafter.head_t is None else out @ drafter.head_t), drafter.vocab_ids
    if isinstance(drafter, ModelDrafter):  # its own next-token logits at t + 1
        model = drafter.model
        logits = model.forward(ids.to(model.device), model.new_cache(ids.shape[0])).logits
        return logits[1:], drafter.vocab_ids
    raise TypeError(f"{type(drafter).__name__}: teacher forcing needs a drafter with a model (eagle, medusa, model)")


def position_hits(engine: SpecEngine, drafter: Drafter, prompt_ids: list[int],
                  answer: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For every answer token (a chain drafts the first too: step one runs the prompt's last token
    with a draft): whether it is among the drafter's top-k (bool [n, len(TOP_K)]), and whether the
    target was confident of it."""
    target = engine.target.model
    ids = torch.tensor(prompt_ids + answer, dtype=torch.long, device=target.device)
    with torch.inference_mode():
        out = target.forward(ids, target.new_cache(ids.shape[0]), return_hidden=True)
        logits, columns = next_next_logits(drafter, ids, out.hidden)
        top = token_ids_of(logits.float().topk(max(TOP_K), dim=-1).indices, columns)  # [L - 1, 10]
    first = len(prompt_ids) - 2  # row t guesses ids[t + 2]: the first drafted token is ids[len(prompt)]
    want = ids[first + 2 :, None]
    got = top[first : ids.shape[0] - 2]
    hits = torch.stack([(got[:, :k] == want).any(-1) for k in TOP_K], dim=-1).cpu()
    confident = (out.logits[first + 1 : -1].float().softmax(-1).amax(-1) > CONFIDENT).cpu()
    return hits, confident


def measure(engine: SpecEngine, drafters: Sequence[str], prompts: Sequence[BenchPrompt],
            max_tokens: int) -> dict[str, dict[str, Agreement]]:
    """{drafter: {domain: Agreement}} over the target's greedy answers to `prompts`."""
    table: dict[str, dict[str, Agreement]] = {name: {} for name in drafters}
    for p in prompts:
        prompt_ids = engine.encode(p.text)
        answer = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens)).token_ids
        domain = CATEGORY_TO_DOMAIN.get(p.category, p.category)
        for name in drafters:
            hits, confident = position_hits(engine, engine.drafters[name], prompt_ids, answer)
            table[name].setdefault(domain, Agreement()).add(hits, confident)
    return table


RACE_POWERS = tuple(sorted({1, RACE_POWER}))  # q as it is, and as model drafters race it


@dataclass
class SampledAgreement:
    """Sums over answer positions of a sampled answer: each a probability that a draft is accepted."""

    positions: int = 0
    overlap: float = 0.0  # sum min(p, q): rejection sampling of a draw from q
    likeliest: float = 0.0  # p(argmax q): exact match of q's likeliest token
    raced: dict[int, float] = field(default_factory=lambda: dict.fromkeys(RACE_POWERS, 0.0))  # by power of q

    def add(self, other: SampledAgreement) -> None:
        self.positions += other.positions
        self.overlap += other.overlap
        self.likeliest += other.likeliest
        for power, v in other.raced.items():
            self.raced[power] += v


def sampled_agreement(engine: SpecEngine, drafter: Drafter, prompt_ids: list[int], answer: list[int],
                      params: SamplingParams, seeds: int) -> SampledAgreement:
    """Over the answer's positions (as `position_hits`), with the sampling settings applied to
    both distributions."""
    target = engine.target.model
    ids = torch.tensor(prompt_ids + answer, dtype=torch.long, device=target.device)
    with torch.inference_mode():
        out = target.forward(ids, target.new_cache(ids.shape[0]), return_hidden=True)
        logits, columns = next_next_logits(drafter, ids, out.hidden)
    first = len(prompt_ids) - 2  # row t guesses ids[t + 2]; the target's row t + 1 predicts it too
    p = probs_from_logits(out.logits[first + 1 : -1].float(), params).cpu()
    q = probs_from_logits(logits[first : ids.shape[0] - 2].float(), params).cpu()
    q = full_vocab_probs(q, None if columns is None else columns.cpu(), p.shape[-1])
    stats = SampledAgreement(positions=p.shape[0], overlap=float(torch.minimum(p, q).sum()),
                             likeliest=float(p.gather(-1, q.argmax(-1, keepdim=True)).sum()))
    draws = [PositionDraws(seed) for seed in range(seeds)]
    for row, (p_row, q_row) in enumerate(zip(p, q)):
        position = len(prompt_ids) + row
        drawn = [d.draw(p_row, position) for d in draws]
        for power in RACE_POWERS:
            raced = q_row**power
            stats.raced[power] += sum(d.draw(raced, position) == t for d, t in zip(draws, drawn)) / seeds
    return stats


def measure_sampled(engine: SpecEngine, drafters: Sequence[str], prompts: Sequence[BenchPrompt], max_tokens: int,
                    temperature: float, seeds: int) -> dict[str, dict[str, SampledAgreement]]:
    """{drafter: {domain: SampledAgreement}} over the target's answers to `prompts` sampled at
    `temperature` (prompt i with seed i)."""
    table: dict[str, dict[str, SampledAgreement]] = {name: {} for name in drafters}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        prompt_ids = engine.encode(p.text)
        answer = engine.generate(prompt_ids, params).token_ids
        domain = CATEGORY_TO_DOMAIN.get(p.category, p.category)
        for name in drafters:
            stats = sampled_agreement(engine, engine.drafters[name], prompt_ids, answer, params, seeds)
            table[name].setdefault(domain, SampledAgreement()).add(stats)
    return table


def render_sampled(table: dict[str, dict[str, SampledAgreement]]) -> str:
    races = " | ".join("race q" if power == 1 else f"race q^{power}" for power in RACE_POWERS)
    lines = [f"| drafter | domain | positions | sum min(p, q) | p(argmax q) | {races} |",
             "|---|---|---:|---:|---:|" + "---:|" * len(RACE_POWERS)]
    for name, domains in table.items():
        total = SampledAgreement()
        for a in domains.values():
            total.add(a)
        for domain, a in [*domains.items(), ("all", total)]:
            n = max(1, a.positions)
            rates = [a.overlap / n, a.likeliest / n, *(a.raced[power] / n for power in RACE_POWERS)]
            lines.append(f"| {name} | {domain} | {a.positions} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
    return "\n".join(lines)


def render(table: dict[str, dict[str, Agreement]]) -> str:
    lines = ["| drafter | domain | positions | top-1 | top-4 | top-10 | target confident | top-1 there | elsewhere |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, domains in table.items():
        for domain, a in domains.items():
            rest = a.positions - a.confident
            there = a.confident_hits / a.confident if a.confident else 0.0
            elsewhere = (a.hits[1] - a.confident_hits) / rest if rest else 0.0
            lines.append(f"| {name} | {domain} | {a.positions} | {a.rate(1):.3f} | {a.rate(4):.3f} | {a.rate(10):.3f} "
                         f"| {a.confident / max(1, a.positions):.2f} | {there:.3f} | {elsewhere:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from workers.config import load_engine_config

    parser = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("bench/trained_drafters.yaml"), help="an engine config")
    parser.add_argument("--drafters", required=True, help="comma list of drafter names in the config")
    parser.add_argument("--prompts", type=Path, required=True, help="Spec-Bench-format questions")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of each answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled answers (see above)")
    parser.add_argument("--seeds", type=int, default=16, help="keyed draws' seeds a sampled position's races run")
    args = parser.parse_args(argv)
    engine = SpecEngine.from_config(load_engine_config(args.config))
    names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    if unknown := [n for n in names if n not in engine.drafters]:
        parser.error(f"--drafters: {', '.join(unknown)} not in {args.config} (has {', '.join(engine.drafters)})")
    if args.per_category <= 0 or args.max_tokens <= 0 or args.seeds <= 0:
        parser.error("--per-category, --max-tokens and --seeds must be positive")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if no_model := [n for n in names if not isinstance(engine.drafters[n], SUPPORTED)]:
        parser.error(f"--drafters: {', '.join(no_model)} has no model to teacher force (kinds eagle, medusa, model)")
    prompts = load_prompts(args.prompts, args.per_category, heldout_mod=HELDOUT_MOD, train_split=args.split == "train")
    if args.temperature > 0:
        print(render_sampled(measure_sampled(engine, names, prompts, args.max_tokens, args.temperature, args.seeds)))
    else:
        print(render(measure(engine, names, prompts, args.max_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
