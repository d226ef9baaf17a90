"""Log-probabilities of generated tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

A token's log-probability is read off the target's raw distribution at its position (log-softmax
of the logits, before penalties, temperature, top-k and top-p), as vLLM reports by default, from
the row that verified it: plain or speculative, the numbers come from the same forward rows, and on
a row-invariant target (int4, bfloat16 weights) they are bit for bit those of plain decoding.
Computed only for requests that ask (`SamplingParams.logprobs`). A prompt's tokens are scored by
the prefill's rows (`SamplingParams.prompt_logprobs`, what `echo` with `logprobs` reports, as
lm-evaluation-harness's loglikelihood requests read them); its first token has no logprob.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from workers.result import Logprob, TokenLogprobs

# what JSON can carry for a token the distribution rules out (-inf), as vLLM writes it
MIN_LOGPROB = -9999.0


class TokenText:
    """A token's text and exact bytes. Byte-level BPE vocabularies (GPT-2's, SmolLM2's) store a
    token as one character per byte, so a token holding part of a UTF-8 character still has its
    own bytes, where decoding it alone gives U+FFFD."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_of = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
        self.added = set(tokenizer.get_added_vocab().values()) if hasattr(tokenizer, "get_added_vocab") else set()
        self._known: dict[int, tuple[str, tuple[int, ...]]] = {}  # at most the vocabulary

    def of(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if (known := self._known.get(token_id)) is None:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self.byte_of is not None and token_id not in self.added and all(c in self.byte_of for c in piece):
                known = text, tuple(self.byte_of[c] for c in piece)
            else:
                known = text, tuple(text.encode("utf-8"))
            self._known[token_id] = known
        return known

    def logprob(self, token_id: int, value: float | None, rank: int | None = None) -> Logprob:
        text, raw = self.of(token_id)
        logprob = None if value is None else max(value, MIN_LOGPROB)
        return Logprob(token_id=token_id, token=text, bytes=raw, logprob=logprob, rank=rank)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int, text: TokenText) -> list[TokenLogprobs]:
    """For each row of logits [n, vocab] the log-probability of token_ids[i] under it, with its
    rank (vLLM's: 1 + the tokens likelier than it), and the row's `num_top` likeliest tokens
    (largest first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = (torch.topk(logprobs, num_top, dim=-1) if num_top
                           else (logprobs.new_empty(len(token_ids), 0), logprobs.new_empty(len(token_ids), 0)))
    return [
        TokenLogprobs(chosen=text.logprob(token, value, rank),
                      top=tuple(text.logprob(int(i), v, r) for r, (i, v) in enumerate(zip(ids, values), 1)))
        for token, value, rank, ids, values in zip(token_ids, chosen[:, 0].tolist(), ranks, top_ids.tolist(),
                                                   top_values.tolist())
    ]
