"""Greedy losslessness: every method's tokens against plain decoding's, prompt by prompt.

A difference is reported where it starts, with the target's top-2 logit gap there: a near-tie
(gap < NEAR_TIE) means two kernels' rounding can legitimately pick different argmaxes, which is
a numerics artefact; a wide gap at the first difference is a bug.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from bench.records import Mismatch, RunRecord
from bench.summary import PLAIN_METHOD, reference_method

if TYPE_CHECKING:  # its import takes seconds; only the hf peers load a transformers model
    from transformers import PreTrainedModel

NEAR_TIE = 1e-3


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gaps(model: PreTrainedModel, prompt_ids: list[int], plain_ids: list[int]) -> list[float]:
    """gaps[i] = top-1 minus top-2 logit for generated position i, i = 0 .. len(plain_ids), from one
    teacher-forced forward over prompt + plain tokens."""
    ids = torch.tensor([prompt_ids + plain_ids], dtype=torch.long, device=model.device)
    # the last len(plain) + 1 rows predict generated positions 0 .. len(plain)
    logits = model(ids, logits_to_keep=len(plain_ids) + 1).logits[0].float()  # [len(plain) + 1, vocab]
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def find_mismatches(
    records: Sequence[RunRecord], prompt_ids: dict[int | str, list[int]],
    load_target: Callable[[], PreTrainedModel],
) -> list[Mismatch]:
    """One Mismatch per (prompt, method) whose tokens differ from its reference's (plain's; for
    llama.cpp's modes llama.cpp's plain output, where no top-2 gap of ours explains anything).
    load_target is called only when there is a mismatch to explain."""
    refs = {(r.method, r.question_id): r for r in records if reference_method(r.method) == r.method}
    gaps: dict[int | str, list[float]] = {}  # one forward per prompt, however many methods differ
    mismatches: list[Mismatch] = []
    for r in records:
        ref = refs.get((reference_method(r.method), r.question_id))
        if ref is None or ref is r:
            continue
        pos = first_difference(ref.token_ids, r.token_ids)
        if pos is None:
            continue
        gap = None
        if ref.method == PLAIN_METHOD:
            if r.question_id not in gaps:
                gaps[r.question_id] = top2_gaps(load_target(), prompt_ids[r.question_id], ref.token_ids)
            gap = gaps[r.question_id][pos]
        mismatches.append(Mismatch(
            question_id=r.question_id, category=r.category, method=r.method, position=pos,
            plain_token=ref.token_ids[pos] if pos < len(ref.token_ids) else None,
            method_token=r.token_ids[pos] if pos < len(r.token_ids) else None,
            top2_gap=gap, near_tie=gap is not None and gap < NEAR_TIE,
        ))
    return mismatches
