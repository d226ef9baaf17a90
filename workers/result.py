"""What a request comes back with, and why one is refused: one torch-free shape for the engine,
the router, the Serve worker and its ingress, the CLI and the benchmarks.

A finished request is a `GenerationResult`: the engine fills its tokens and step statistics, the
router adds its `RoutingReport`, the worker sends it (without the per-step detail) with the
request's last chunk, and the HTTP response, the CLI's JSON and the benchmark's run records are
read off it. A request the service cannot serve as asked raises `RequestError`, naming the field;
the ingress answers it with HTTP 400 and the CLI with exit status 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from policies.records import ContextSpan


class RequestError(ValueError):
    """A request that cannot be served as asked: `message` says why, `param` names the request
    field (prompt, drafter, max_tokens, speculation.domain, ...), `code` an OpenAI error code.
    Crosses Ray's process boundary, so its arguments are its state (pickled as given)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param, code)
        self.message, self.param, self.code = message, param, code

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class StepStats:
    """One step of one request: what it drafted, kept and emitted, and what it cost."""

    drafter: str  # PLAIN for a step that asked no drafter (a drafter may still propose nothing)
    draft_len: int  # k asked for (after clipping to the token budget)
    num_draft_tokens: int  # k' the drafter proposed (a tree: its depth, the positions drafted)
    num_accepted: int
    num_emitted: int  # tokens appended after EOS / stop / max_tokens trimming
    draft_s: float
    verify_s: float  # the target forward plus verification
    context_len: int  # tokens before the step
    fallback_reason: str | None = None
    num_tree_nodes: int = 0  # a tree draft's tokens, all verified in the step (0: a chain)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target's raw distribution (workers/logprobs.py)."""

    token_id: int
    token: str  # its text alone (U+FFFD where it holds part of a character)
    bytes: tuple[int, ...]  # its UTF-8 bytes
    logprob: float | None  # None: a prompt's first token, which no position predicts
    rank: int | None = None  # 1: the likeliest token at its position; None: no position predicts it


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the likeliest tokens at its position."""

    chosen: Logprob
    top: tuple[Logprob, ...]  # largest first; as many as the request asked


@dataclass(frozen=True)
class PredictionTokens:
    """What a request's predicted output (OpenAI's `prediction`) was worth: its tokens drafted and
    accepted as output, and drafted but rejected (verified at a cost, never emitted)."""

    accepted: int
    rejected: int


@dataclass(frozen=True)
class Segment:
    """Consecutive steps with the same drafter and k."""

    drafter: str
    draft_len: int
    num_steps: int


@dataclass(frozen=True)
class RoutingReport:
    """How one request was routed; returned with its response."""

    domain: str
    domain_source: str  # request, rule, model or default
    confidence: float
    policy_version: str
    drafter: str  # the plan's drafter (PLAIN: the request started plain)
    draft_len: int
    reason: str  # the plan's reason: best, explore, fallback, policy or forced
    predicted_speedup: float
    schedule: tuple[Segment, ...]  # the (drafter, k) asked for each step, run-length encoded
    fallbacks: tuple[str, ...]  # the reason of each switch to plain decoding
    context: tuple[ContextSpan, ...] = ()  # the steps per context bucket, in the order crossed

    @property
    def fallback_reason(self) -> str | None:
        return self.fallbacks[-1] if self.fallbacks else None

    def to_json(self) -> dict[str, Any]:
        """The report as the CLI's JSON and the benchmark's run records write it."""
        return {
            "domain": self.domain, "domain_source": self.domain_source, "confidence": round(self.confidence, 4),
            "policy_version": self.policy_version, "drafter": self.drafter, "draft_len": self.draft_len,
            "reason": self.reason, "predicted_speedup": round(self.predicted_speedup, 4),
            "schedule": [[s.drafter, s.draft_len, s.num_steps] for s in self.schedule],
            "fallbacks": list(self.fallbacks), "context": [asdict(span) for span in self.context],
        }


@dataclass(frozen=True)
class GenerationResult:
    """A finished request: its tokens and text, how its steps drafted and verified, and how it
    was routed."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    num_steps: int  # target forwards that emitted tokens (the prompt's prefill is not one)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]  # steps whose draft token at position i was accepted
    drafted_per_position: list[int]  # steps that proposed a token at position i
    drafters: list[str]  # every drafter that proposed, in order of first use
    prefill_s: float  # the prompt's forward, except its last token (that is in step one)
    wall_s: float
    ttft_s: float  # from the request's start (queueing included) to its first step's tokens
    steps: list[StepStats] = field(repr=False, default_factory=list)  # empty on the wire
    routing: RoutingReport | None = None  # how the router ran it (None: a bare engine request)
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when the request asked
    # one per prompt token (the first without a logprob), when the request asked (`prompt_logprobs`)
    prompt_logprobs: list[TokenLogprobs] | None = None
    prediction: PredictionTokens | None = None  # when the request predicted its output
    num_cached_tokens: int = 0  # prompt tokens whose keys and values were reused, not prefilled (workers/prefix.py)
    num_reasoning_tokens: int = 0  # of token_ids, a reasoning model's thinking (the worker's, workers/reasoning.py)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (else None)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward, bonus included (Spec-Bench's MAT)."""
        return len(self.token_ids) / self.num_steps if self.num_steps else 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)
