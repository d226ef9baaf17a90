"""Spec-Bench prompts: one JSON object per line with question_id, category and turns.

Only the first turn is benchmarked: the second turn of a Spec-Bench question follows the model's
own first answer, which would make the prompt depend on the method that produced it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from policies.classifier import is_heldout


def _int_or_none(value: int | str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str
    text: str  # the first turn


def load_prompts(
    path: Path, per_category: int, categories: list[str] | None = None, heldout_mod: int | None = None,
    train_split: bool = False,
) -> list[BenchPrompt]:
    """The first `per_category` questions of each category, categories in file order;
    `categories` keeps only those (every name must exist in the file); `heldout_mod` keeps only
    the held-out split the classifier never trained on (question_id % heldout_mod == 0), or with
    `train_split` only the rest."""
    if per_category <= 0:
        raise ValueError(f"per_category must be positive, got {per_category}")
    by_category: dict[str, list[BenchPrompt]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            prompt = BenchPrompt(q["question_id"], str(q["category"]), str(q["turns"][0]))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            reason = f"{type(e).__name__}: {e}"
            raise ValueError(f"{path}:{lineno}: not a Spec-Bench question ({reason})") from None
        if heldout_mod is None or is_heldout(_int_or_none(prompt.question_id), heldout_mod) != train_split:
            by_category.setdefault(prompt.category, []).append(prompt)

    wanted = list(by_category)
    if categories is not None:
        asked = list(dict.fromkeys(c.strip() for c in categories if c.strip()))
        if unknown := [c for c in asked if c not in by_category]:
            raise ValueError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))} "
                f"in {path}; available: {', '.join(by_category)}"
            )
        wanted = [c for c in by_category if c in asked]
    prompts = [p for c in wanted for p in by_category[c][:per_category]]
    if not prompts:
        raise ValueError(f"{path}: no questions selected")
    ids = [p.question_id for p in prompts]
    if len(set(ids)) != len(ids):  # records are matched to plain's by question_id
        raise ValueError(f"{path}: question_id values are not unique among the selected questions")
    return prompts
