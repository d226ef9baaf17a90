"""What a run writes beside its drafter: the training summary in the drafter's config and the
parts of CARD.md that every kind's card shares."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from training.args import SAVE_DTYPES, TrainArgs
from training.data import SHARE_OF_CORPUS
from workers.drafters.eagle import EagleNet
from workers.drafters.medusa import MedusaHeads

CARD_FILE = "CARD.md"
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")
SUMMARY_KEYS = ("format", "step", "train_s", "corpus", "windows", "draft_vocab", "eval_initial")


def last_entry(record: dict[str, Any]) -> dict[str, Any]:
    """The latest checkpoint's history entry ({} before the first)."""
    return record["history"][-1] if record["history"] else {}


def training_summary(record: dict[str, Any], args: TrainArgs, keys: tuple[str, ...] = SUMMARY_KEYS,
                     train_final: bool = False) -> dict[str, Any]:
    """The record's gist for the drafter's config (`specroute_training`): `keys` of the record, the
    final held-out scores (and training averages with `train_final`), the run's data and sessions."""
    last = last_entry(record)
    summary = {k: record[k] for k in keys} | {"steps": args.steps, "eval_final": last.get("eval") if last else None}
    if train_final:
        summary["train_final"] = last.get("train") if last else None
    return summary | {"target": args.target, "data": args.data, "sessions": record["sessions"]}


def save_net(out: Path, net: EagleNet | MedusaHeads, summary: dict[str, Any], save_dtype: str) -> None:
    """A copy of `net` in the saved dtype, written in its own layout with the summary in its config."""
    cpu = copy.deepcopy(net).to("cpu")
    cpu.to(SAVE_DTYPES[save_dtype])  # floating tensors only: draft_vocab stays int64
    cpu.save(out, extra_config={"specroute_training": summary})


def held_out_note(record: dict[str, Any]) -> str:
    """The card's sentence on the held-out windows: how many, and where from."""
    w = record["windows"]
    origin = w.get("held_out_from", SHARE_OF_CORPUS)
    if (sources := w.get("held_out_sources")) is not None:  # --eval-data: a corpus of its own
        origin = f"`{origin}`, a separate corpus of {sum(s['tokens'] for s in sources.values())} tokens"
    return f"{w['held_out']} held out (never trained on; {origin}) for the numbers below."


def run_lines(record: dict[str, Any], args: TrainArgs, features: str) -> str:
    """The card's list of the run: status, commands, time; `features` says where they came from."""
    status = "complete" if record["step"] >= args.steps else f"partial: step {record['step']} of {args.steps}"
    sessions = "\n".join(f"  - `{c}`" for c in record["sessions"])
    return f"""- Status: {status} ({record['updated']})
- Commands (one per session; `--resume` continues):
{sessions}
- Training time: {record['train_s']:.1f} s of steps over {record['step']} steps; features: \
{record['corpus']['tokens']} tokens
  {features}"""


def data_section(record: dict[str, Any]) -> str:
    """The card's table of the corpus's sources."""
    sources = "\n".join(f"| `{label}` | {s['documents']} | {s['tokens']} |"
                        for label, s in record["corpus"]["sources"].items())
    return f"""## Data (never Spec-Bench's held-out split)

| source | documents | tokens |
|---|---|---|
{sources}"""


def windows_line(record: dict[str, Any], args: TrainArgs, unit: str) -> str:
    return (f"Training windows of at most {args.seq_len} {unit}: {record['windows']['train']} trained on,\n"
            f"{held_out_note(record)}")


def mat_section(note: str = "") -> str:
    """The card's empty table of Spec-Bench results, for `specroute bench` to fill in."""
    categories = "\n".join(f"| {c} | | | |" for c in SPEC_BENCH_CATEGORIES)
    lead = f"{note}\n\n" if note else ""
    return f"""## Mean accepted tokens per step (MAT) on Spec-Bench, greedy

{lead}| category | MAT | k | prompts |
|---|---|---|---|
{categories}
"""
