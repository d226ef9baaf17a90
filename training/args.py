"""The settings every drafter trainer shares, their checks, and the error a bad one raises.

Each kind subclasses `TrainArgs` with its own settings and its own defaults for the shared ones
that have none here (batch, seq_len, lr, grad_clip, eval_windows: what suits one kind does not
suit another)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from training.corpus import parse_sources

MIN_LR_RATIO = 0.1  # cosine decay ends at lr * this
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# settings a resume may change; every other one defines the run and must stay as it was
RESUME_MAY_CHANGE = frozenset({"out", "steps", "stop_at", "save_every", "device", "save_dtype", "resume", "command"})


class TrainError(ValueError):
    """A user error in the training settings or state; the message names the setting or file."""


def warmup_steps(warmup: int | None, steps: int) -> int:
    """--warmup, or by default 5% of the steps (1 .. 1000)."""
    return warmup if warmup is not None else max(1, min(1000, round(0.05 * steps)))


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """The `specroute train-drafter` settings of every kind; the five without a default here take
    the kind's."""

    target: str
    data: str
    out: str
    features: str | None = None  # an earlier run's features file instead of running the target
    max_tokens: int = 1_000_000
    draft_vocab: int = 8192  # 0: the target's full vocabulary
    chunk_len: int = 512  # tokens per target forward during feature extraction
    steps: int = 2000
    batch: int
    seq_len: int  # pairs per training window
    lr: float
    warmup: int | None = None  # None: 5% of steps (1 .. 1000)
    weight_decay: float = 0.0
    grad_clip: float
    seed: int = 0
    device: str = "cpu"
    save_every: int = 500
    stop_at: int | None = None  # stop (with a checkpoint) after this step; --resume continues
    eval_windows: int  # held-out windows, never trained on (of --data's: at most a tenth)
    eval_data: str | None = None  # sources of separate held-out text (default: a share of --data's windows)
    save_dtype: str = "float32"
    resume: bool = False
    command: str = ""

    # the sizes that must be positive, in the order they are checked
    positive: ClassVar[tuple[str, ...]] = ("max_tokens", "chunk_len", "steps", "batch", "seq_len", "save_every")

    def warmup_steps(self) -> int:
        return warmup_steps(self.warmup, self.steps)

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to MIN_LR_RATIO * lr at `steps`."""
        warmup = self.warmup_steps()
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.steps - warmup))
        return self.lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))

    def resume_must_match(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if f.name not in RESUME_MAY_CHANGE)

    def check(self) -> None:
        """The shared settings; a kind checks its own on top (after these)."""
        for name in self.positive:
            if getattr(self, name) <= 0:
                raise TrainError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.draft_vocab < 0:
            raise TrainError(f"--draft-vocab must be >= 0 (0: the full vocabulary), got {self.draft_vocab}")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise TrainError("--lr and --grad-clip must be positive")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise TrainError(f"--stop-at must be in 1..--steps ({self.steps}), got {self.stop_at}")
        if self.save_dtype not in SAVE_DTYPES:
            raise TrainError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}")
        if self.eval_data is not None:
            if self.eval_windows == 0:
                raise TrainError("--eval-data needs --eval-windows > 0: the windows it holds out")
            parse_sources(self.eval_data)  # a bad source fails before the target loads
