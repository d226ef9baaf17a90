"""Spec-Bench prompts: one JSON object per line with question_id, category and turns.

Only the first turn is benchmarked: the second turn of a Spec-Bench question follows the model's
own first answer, which would make the prompt depend on the method that produced it. A line may
instead carry `messages` ([{role, content}], earlier answers written out, as in
bench/workloads/): the whole conversation is the prompt. A line may also carry `prediction`: the
output the request predicts (OpenAI's Predicted Outputs), sent with it to every method of ours,
and `response_format` (OpenAI's shape): the format its output must match, for every method of ours
(the peers do not take one, so a file with formats runs ours alone).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from policies.classifier import is_heldout
from router.schemas import ResponseFormat
from workers.structured import OutputFormat

SPEC_BENCH = Path("../shared/data/spec_bench/question.jsonl")  # from the repository root
ENGINE_CONFIG = Path("deploy/serve.cpu.yaml")  # what `make serve` runs


def add_source_arguments(ap: argparse.ArgumentParser) -> None:
    """`--config` (the engine or Serve config a benchmark builds its engine from) and `--prompts`
    (a question file, Spec-Bench's by default)."""
    ap.add_argument("--config", type=Path, default=ENGINE_CONFIG, help="engine or Serve config YAML")
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)


def _int_or_none(value: int | str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str
    text: str  # the first turn; with `messages`, the last user message (what the classifier reads)
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) of a whole conversation
    prediction: str | None = None  # the output the request predicts
    response_format: ResponseFormat | None = None  # what the output must match

    @property
    def output_format(self) -> OutputFormat | None:
        return None if self.response_format is None else self.response_format.output_format

    def conversation(self) -> list[dict[str, str]]:
        """The messages an OpenAI-style request carries: the text as one user message, or the
        whole conversation."""
        return [{"role": role, "content": content} for role, content in self.messages or [("user", self.text)]]

    def chat(self) -> str | list[dict[str, str]]:
        """What the engine encodes through the chat template (a bare text: as one user message)."""
        return self.text if self.messages is None else self.conversation()


def _parse(q: dict) -> BenchPrompt:
    prediction = None if q.get("prediction") is None else str(q["prediction"])
    fmt = None if q.get("response_format") is None else ResponseFormat.model_validate(q["response_format"])
    if "messages" in q:
        messages = tuple((str(m["role"]), str(m["content"])) for m in q["messages"])
        text = next(content for role, content in reversed(messages) if role == "user")
        return BenchPrompt(q["question_id"], str(q["category"]), text, messages, prediction, fmt)
    return BenchPrompt(q["question_id"], str(q["category"]), str(q["turns"][0]), prediction=prediction,
                       response_format=fmt)


def load_prompts(
    path: Path, per_category: int, categories: list[str] | None = None, heldout_mod: int | None = None,
    train_split: bool = False, file_order: bool = False,
) -> list[BenchPrompt]:
    """The first `per_category` questions of each category, categories in file order (with
    `file_order`, the selected questions in file order instead: a workload whose requests must
    run as a service would see them); `categories` keeps only those (every name must exist in the
    file); `heldout_mod` keeps only the held-out split the classifier never trained on
    (question_id % heldout_mod == 0), or with `train_split` only the rest."""
    if per_category <= 0:
        raise ValueError(f"per_category must be positive, got {per_category}")
    by_category: dict[str, list[BenchPrompt]] = {}
    line_of: dict[int, int] = {}  # id(prompt) -> its line
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompt = _parse(json.loads(line))
            line_of[id(prompt)] = lineno
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, StopIteration) as e:
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
    if file_order:
        prompts.sort(key=lambda p: line_of[id(p)])
    if not prompts:
        raise ValueError(f"{path}: no questions selected")
    ids = [p.question_id for p in prompts]
    if len(set(ids)) != len(ids):  # records are matched to plain's by question_id
        raise ValueError(f"{path}: question_id values are not unique among the selected questions")
    return prompts
