"""Tokens a verified row may not take (vLLM's `allowed_token_ids`, `min_tokens`, `bad_words`).

Like a penalty (workers/penalties.py), a ban can depend on the tokens before the row: `min_tokens`
on how many the output holds, a bad word on the tokens just before. Row r of a step sees the
output plus the draft tokens on its own path (a chain's first r, a tree node's ancestors and
itself), so it is masked exactly as plain decoding would mask that position, and verification
stays lossless. The rules are vLLM's: outside `allowed_token_ids` nothing may be taken; before
the output holds `min_tokens` tokens no stop token may (the stop strings wait as well,
workers/engine.py); a bad word's last token may not follow its other tokens, a one-token word
never. A ban sets the logit to -inf, so greedy decoding skips the token and sampling gives it no
mass.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from workers.sampling import SamplingParams


@dataclass(frozen=True)
class Bans:
    """A request's bans, built once: what `ban` needs beyond the step's tokens."""

    outside: torch.Tensor | None  # [vocab] bool: the tokens outside allowed_token_ids (None: none)
    min_tokens: int
    stop_ids: torch.Tensor  # [s] long: banned while the output is shorter than min_tokens
    bad_words: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: Collection[int], vocab_size: int,
           device: torch.device | str = "cpu") -> Bans:
        outside = None
        if params.allowed_token_ids is not None:
            outside = torch.ones(vocab_size, dtype=torch.bool, device=device)
            outside[torch.tensor(sorted(params.allowed_token_ids), dtype=torch.long, device=device)] = False
        return cls(outside, params.min_tokens, torch.tensor(sorted(stop_ids), dtype=torch.long, device=device),
                   params.bad_words)


def ban(logits: torch.Tensor, bans: Bans, output_ids: Sequence[int], draft_ids: torch.Tensor,
        sees: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] of a step's rows with each row's banned tokens at -inf (a new tensor).
    `sees` [n, k] bool: draft token j is on row r's path."""
    logits = logits.float().clone()
    if bans.outside is not None:
        logits.masked_fill_(bans.outside[: logits.shape[-1]], float("-inf"))
    if bans.min_tokens > len(output_ids) and bans.stop_ids.numel():
        short = (len(output_ids) + sees.sum(dim=1) < bans.min_tokens).nonzero().flatten()
        logits[short[:, None], bans.stop_ids[None, :]] = float("-inf")
    if bans.bad_words:
        for row, token in _bad_word_ends(bans.bad_words, output_ids, draft_ids.tolist(), sees.tolist()):
            logits[row, token] = float("-inf")
    return logits


def _bad_word_ends(words: Sequence[Sequence[int]], output_ids: Sequence[int], draft: list[int],
                   sees: list[list[bool]]) -> list[tuple[int, int]]:
    """(row, token) pairs: a word's last token after its others, on the row's own history."""
    longest = max(len(w) for w in words) - 1
    before = list(output_ids[max(0, len(output_ids) - longest) :])
    banned = []
    for r, path in enumerate(sees):
        history = before + [t for t, on in zip(draft, path, strict=True) if on]
        for word in words:
            head = len(word) - 1
            if head == 0 or (len(history) >= head and history[len(history) - head :] == list(word[:-1])):
                banned.append((r, word[-1]))
    return banned
