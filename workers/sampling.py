"""Sampling parameters and the functions that turn logits into tokens or the distribution sampled from.

Plain sampling, the target side of rejection sampling and the drafter's proposals all go through
`probs_from_logits`, so temperature, min-p, top-k and top-p are applied to all three exactly alike;
greedy decoding and greedy drafts take `greedy_ids`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.config import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
)
from workers.structured import OutputFormat

DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = whole vocabulary
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p x the likeliest are dropped (0: none)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the output text ends with the stop string found
    ignore_eos: bool = False
    extra_stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # vLLM's stop_token_ids
    # workers/bans.py: tokens a row may not take, vLLM's names
    min_tokens: int = 0  # no stop token (nor stop string) before this many output tokens
    allowed_token_ids: frozenset[int] | None = None  # None: any token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences: the last is banned after the others
    skip_special_tokens: bool = True  # the output text leaves special tokens out
    logprobs: int | None = None  # None: none; n: each token's logprob and its position's n likeliest
    prompt_logprobs: int | None = None  # the same for each prompt token (the prefill keeps every row's logits)
    # workers/penalties.py: OpenAI's and vLLM's, applied to every verified row
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    # token id -> added to its logit; compared, not hashed (params stay usable as a key)
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    # the output the request predicts (OpenAI's Predicted Outputs), as token ids: a source of drafts
    # (workers/drafters/prediction.py), never of output
    prediction: tuple[int, ...] = ()
    # what the output must match (workers/structured.py): every verified row is masked to it
    output_format: OutputFormat | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must list at least one token")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words allows at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if any(not word for word in self.bad_words):
            raise ValueError("bad_words holds a word of no tokens")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop allows at most {MAX_STOP_SEQUENCES} strings, got {len(self.stop)}")
        if (longest := max(map(len, self.stop), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {token}: {bias}")

    @property
    def penalized(self) -> bool:
        """Whether logits are biased or penalised before tokens are chosen (workers/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def bans(self) -> bool:
        """Whether some rows may not take some tokens (workers/bans.py)."""
        return bool(self.min_tokens or self.allowed_token_ids is not None or self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_TOP_P_FIRST_RANKS = 256  # ranks a top-p cut looks at first; 4x more each time they hold too little mass


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, min-p, top-k,
    top-p, in vLLM's order. min-p compares logits: p < min_p * p_max is l < l_max + log(min_p)."""
    logits = logits.float() / params.temperature  # a new tensor: masked in place below
    if params.min_p > 0:
        floor = logits.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        logits.masked_fill_(logits < floor, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return _nucleus(probs, params.top_p) if params.top_p < 1 else probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs kept on the nucleus and renormalised: a token is dropped where the tokens ranked above
    it already hold top_p of the mass, tokens of equal probability ranked by id. Only the ranks
    that can be inside are sorted: the top r by probability (topk), r grown until they hold top_p
    in every row and the nucleus's last probability ends above rank r's, so every token below them
    is dropped, and the result is built from those r alone. A full sort of 49,152 logits took
    2.4 ms a row on a 2-core CPU, and masking the vocabulary for a second softmax 0.05-0.1 ms; a
    nucleus is mostly a few dozen tokens.

    A row's nucleus must not depend on the other rows of its call (a draft's rows, a batch): how
    many ranks topk sorts does, and topk orders equal probabilities arbitrarily, so ties are put
    in id order and the nucleus ends only where its equals all lie within the ranks sorted."""
    vocab = probs.shape[-1]
    ranks = min(_TOP_P_FIRST_RANKS, vocab)
    while True:
        top, order = torch.topk(probs, ranks, dim=-1)  # sorted, largest first
        mass = top.cumsum(dim=-1)  # equal values in any order sum to the same running mass
        kept = (mass - top < top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # the likeliest always stays
        if ranks == vocab or bool(((mass[..., -1:] >= top_p) & (top[..., -1:] < top.gather(-1, kept - 1))).all()):
            break
        ranks = min(4 * ranks, vocab)
    # ties in id order: sort the ranks by id, then stably by probability
    order, by_id = order.sort(dim=-1)
    top, by_prob = top.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, by_prob)
    kept_probs = top.masked_fill(torch.arange(ranks, device=probs.device) >= kept, 0.0)
    # the kept ranks are a prefix: their sum is the running mass at the last, whatever r is
    return torch.zeros_like(probs).scatter_(-1, order, kept_probs / mass.gather(-1, kept - 1))


def sample_ids(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw from each row of probs [..., vocab] (non-negative; normalised or not) -> ids [...]:
    the row's cumulative mass, in float64, inverted at one uniform draw, exact to ~1e-16 of the
    mass. torch.multinomial draws an exponential per token instead: 1.2 ms a row of SmolLM2's
    49,152 on a 2-core CPU against 0.1 ms, and a sampled step of 16 requests spent 19 ms in it.
    A draw at a token boundary moves with the slightest change of the mass before it: the same
    request gives the same tokens alone and in a batch where the target computes a row alike in
    any batch (int4, bfloat16), as greedy decoding does."""
    u = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float64, device=probs.device)
    return sample_at(probs, u)


def sample_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample_ids` at given uniform draws u [...] in [0, 1): the token whose share of the row's
    cumulative mass holds u."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[..., -1:]
    if not bool(((total > 0) & total.isfinite()).all()):
        raise ValueError("cannot sample from a distribution without finite, positive mass")
    scaled = u.to(device=probs.device, dtype=torch.float64).unsqueeze(-1) * total
    return torch.searchsorted(cdf, scaled, right=True).clamp_max_(probs.shape[-1] - 1)[..., 0]


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
# a token whose probability is at least this share of its row's mass races on its own keyed
# exponential; the rest of the row races as one (PositionDraws.draw)
_HEAD_SHARE = 1e-3
# the words of a position's row: slot 0 the tail's exponential, 1 the tail's uniform, token v slot v + 2
_TAIL_RACE, _TAIL_PICK, _FIRST_TOKEN = 0, 1, 2


def _mix64(x: np.ndarray | np.uint64) -> np.ndarray | np.uint64:
    """splitmix64's finaliser over uint64 words (call under np.errstate(over="ignore"): the
    products wrap modulo 2**64): a bijection whose outputs of neighbouring inputs look independent
    (Steele et al. 2014)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _unit(words: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1) from 64-bit words: their top 53 bits, centred (never 0, so -log is finite)."""
    return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


@dataclass(frozen=True)
class PositionDraws:
    """A seeded request's draws keyed by its seed and each token's position, not taken in turn
    from a stream: the token at position t is `draw(p_t, t)`, whatever drafted it and however many
    tokens each step verified. A step verifies a draft by exact match against these draws
    (workers/verify.py `verify_drawn`), as greedy decoding matches the argmax, so the output is the
    one plain sampling with the seed gives, under any drafter, routing and batch, wherever the
    target scores a row alike in any call (int4, bfloat16; see workers/models/quant.py).

    The draw is an exponential race: token v gets E(seed, t, v), an exponential keyed by the seed,
    the position and the token (splitmix64), and the least E / p(v) wins, which is a draw from p.
    The race couples drafts to the target without either seeing the other's distribution: a
    drafter that races its own q on the same E(seed, t, v) (`draw` of q) proposes the target's
    token with probability near sum min(p, q) (Gumbel coupling; Daliri et al. 2024, "Coupling
    without Communication and Drafter-Invariant Speculative Decoding"), where its likeliest token
    is accepted with p(argmax q). Tokens below 1e-3 of the row's mass race as one: the least of
    their ratios is an exponential over their summed mass, and which of them it is, a draw by
    their shares (keyed too), so a row costs tens to hundreds of exponentials, not the vocabulary's."""

    seed: int

    def _words(self, position: int, slots: np.ndarray) -> np.ndarray:
        golden = np.uint64(_GOLDEN)
        with np.errstate(over="ignore"):
            row = _mix64(_mix64(np.uint64(self.seed & _MASK64)) + np.uint64(position + 1) * golden)
            return _mix64(row + (slots.astype(np.uint64) + np.uint64(1)) * golden)

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The token at `position` of a row of probabilities [vocab] (non-negative; normalised or
        not): 170-200 us a row of SmolLM2's 49,152 at 0.7 on a 2-core CPU."""
        p = probs.detach().float().cpu().numpy()
        total = float(p.sum(dtype=np.float64))
        if not (total > 0 and math.isfinite(total)):
            raise ValueError("cannot sample from a distribution without finite, positive mass")
        head = np.flatnonzero(p >= _HEAD_SHARE * total)
        head_p = p[head].astype(np.float64)
        units = _unit(self._words(position, np.concatenate(([_TAIL_RACE, _TAIL_PICK], head + _FIRST_TOKEN))))
        ratios = -np.log(units[_FIRST_TOKEN:]) / head_p  # the head's exponentials over their probabilities
        best = int(np.argmin(ratios))  # the head holds the likeliest token: never empty
        # the tail's least ratio is an exponential over its mass; only where it wins is its mass summed exactly
        if (tail := total - float(head_p.sum())) > 0 and -math.log(units[_TAIL_RACE]) / tail < ratios[best]:
            rest = p.copy()
            rest[head] = 0.0
            cdf = np.cumsum(rest, dtype=np.float64)
            if cdf[-1] > 0:  # which of its tokens: drawn by their shares
                return min(int(np.searchsorted(cdf, units[_TAIL_PICK] * cdf[-1], side="right")), p.shape[0] - 1)
        return int(head[best])

    def race(self, token_ids: Sequence[int], weights: Sequence[float], position: int) -> int:
        """The winner at `position` of a race among `token_ids` alone at their `weights` (> 0):
        `draw` of the distribution over those tokens, without a row of the vocabulary (a drafter's
        few candidates), on the same keyed exponentials."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        units = _unit(self._words(position, tokens + _FIRST_TOKEN))
        return int(tokens[np.argmin(-np.log(units) / np.asarray(weights, dtype=np.float64))])


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): each row's first largest logit (a NaN counts as largest, as in
    torch). On a CPU through numpy's vectorised argmax, which returns the same index: torch
    2.13's CPU argmax runs scalar, 66 us a row of SmolLM2's 49,152 logits against numpy's 4, so
    a step of 16 requests verifying 39 rows spent 1.3 ms in it instead of 0.2."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(axis=-1)))
    return logits.argmax(dim=-1)


def log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] log-probabilities a drafter ranks its candidates by: the raw model's when
    decoding greedily, else those of the distribution sampled from (-inf where it has no mass)."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return probs_from_logits(logits, params).log()


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: seeded when asked, otherwise from fresh entropy."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
