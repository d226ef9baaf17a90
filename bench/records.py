"""What a benchmark run records: one `RunRecord` per (prompt, method), summaries, mismatches.

Field names are the `results.json` contract; `dataclasses.asdict` gives the JSON objects.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunRecord:
    question_id: int | str
    category: str
    method: str
    token_ids: list[int]  # generated tokens only, up to and including EOS
    num_new_tokens: int
    wall_s: float  # the whole generate call, prefill included, timed the same way for every method
    # target forwards that produced tokens. Ours: verify steps (the prefill of prompt[:-1] emits
    # nothing and is not one). transformers: every forward of the target model, its prefill
    # included, since that one emits the first token. Plain decoding: num_steps == num_new_tokens.
    num_steps: int | None
    num_draft_tokens: int | None
    num_accepted_tokens: int | None
    accepted_per_position: list[int] | None  # steps that accepted the draft token at position i
    # steps that proposed a token at position i: the denominator of the per-position rate
    # (drafts vary in length, so "all drafted steps" would understate late positions).
    # None where the method does not expose it (transformers' generate).
    drafted_per_position: list[int] | None
    routing: dict | None = None  # the router method: domain, plan, schedule, fallbacks
    draft_s: float | None = None  # seconds spent proposing (our engine's methods)
    verify_s: float | None = None  # seconds in the target's verify forwards (our engine's methods)
    ttft_s: float | None = None  # to the first step's tokens, prefill included (our engine's methods)
    first_draft_s: float | None = None  # the first step's proposing: a drafter catching up on the prompt


@dataclass
class MethodSummary:
    speedup: float | None  # plain wall / method wall over the same prompts (Spec-Bench)
    mat: float | None  # new tokens / target forwards, bonus included
    tokens_per_s: float | None
    lossless: bool | None  # every prompt's token_ids equal plain's; None: a sampled run
    ttft_s: float | None = None  # mean time to the first tokens (prefill + first step)
    itl_s: float | None = None  # mean time per token after the first: the decode phase
    decode_speedup: float | None = None  # plain's decode-phase time / the method's (prefill excluded)
    draft_ms: float | None = None  # proposing, per target step
    first_draft_ms: float | None = None  # the first step's proposing (catching up on the prompt), per request
    verify_ms: float | None = None  # the verify forward, per target step


@dataclass
class Mismatch:
    question_id: int | str
    category: str
    method: str
    position: int  # first generated position where the method differs from its reference (plain)
    plain_token: int | None  # the reference's token; None: it had stopped there
    method_token: int | None  # None: the method had stopped there
    top2_gap: float | None  # target's top-1 minus top-2 logit there (transformers); None for llama.cpp's modes
    near_tie: bool  # top2_gap < NEAR_TIE: a rounding difference can flip the argmax there
