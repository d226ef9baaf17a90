"""Logit bias and repetition penalties (OpenAI's `logit_bias`, `presence_penalty`,
`frequency_penalty`; vLLM's `repetition_penalty`), applied to every row a step verifies.

A penalty depends on the tokens before the row, so a verify step's rows each see their own
history: the request's output so far plus the draft tokens on the row's path (a chain's first
i tokens, a tree node's ancestors and itself). Row r of a step then holds exactly the logits
plain decoding would have penalised at that position, and verification stays lossless:
greedy output equals plain decoding's with the same penalties, sampled output follows the
penalised distribution. The formulas are vLLM's: with c the token's count in the output and
its path, `logits -= frequency_penalty * c + presence_penalty * (c > 0)`; a token seen in the
prompt, the output or the path has a positive logit divided by `repetition_penalty` and a
negative one multiplied by it. `logit_bias` is added first.
"""

from __future__ import annotations

import torch

from workers.sampling import SamplingParams


def path_counts(output_ids: list[int], draft_ids: torch.Tensor, sees: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab] float32 token counts each row's position has behind it: the output's, plus the
    draft tokens row r sees (`sees` [n, k] bool: draft token j is on row r's path)."""
    device = draft_ids.device
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=device), minlength=vocab_size)
    counts = base.to(torch.float32).expand(sees.shape[0], -1).clone()
    rows, cols = sees.nonzero(as_tuple=True)
    if rows.numel():
        counts.index_put_((rows, draft_ids[cols]), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
    return counts


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor | None,
             params: SamplingParams) -> torch.Tensor:
    """logits [n, vocab] biased and penalised as above: `counts` from `path_counts`, `prompt_seen`
    [vocab] bool the prompt's tokens (needed only for a repetition penalty)."""
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_seen is not None:
            seen |= prompt_seen
        scaled = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    return logits
