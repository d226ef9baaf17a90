"""The Medusa-1 drafter kind (`specroute train-drafter --kind medusa`): heads on the frozen target.

Head i reads the target's final-norm feature f_t and proposes token t + 2 + i (the target's own
head gives t + 1; workers/drafters/medusa.py drafts the same way). The label is the target's own
distribution for that token, softmax(f_{t+1+i} @ lm_head) over the draft vocabulary (self-
distillation: what the target would verify, also on text the target did not write). Loss:
sum_i decay^i * CE_i (Medusa's 0.8^i weighting). Heads are Medusa's residual blocks, starting as
the identity (zero weights: every head starts as the target's next-token guess); they share one
frozen head, the target's lm_head rows of the draft vocabulary.

Features come from the corpus by teacher forcing (training/features.py), or from an earlier
run's features file (`--features`, e.g. an EAGLE run's train_state/features.safetensors: the
same target, so the same numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from training.args import TrainArgs, TrainError
from training.data import Window, draft_head_t
from training.features import FeatureSet
from training.output import data_section, last_entry, mat_section, run_lines, save_net, windows_line
from training.trainer import DrafterKind, train
from workers.drafters.medusa import MedusaConfig, MedusaHeads
from workers.models.llama import FastLlama

FORMAT = "specroute-medusa-train/1"
BETAS = (0.9, 0.999)


@dataclass(frozen=True, kw_only=True)
class MedusaTrainArgs(TrainArgs):
    num_heads: int = 3
    num_layers: int = 1
    decay: float = 0.8  # head i's loss weight: decay ** i
    positive: ClassVar[tuple[str, ...]] = ("max_tokens", "chunk_len", "num_heads", "num_layers", "steps", "batch",
                                           "seq_len", "save_every")
    # Medusa's defaults of the shared settings
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3  # Medusa-1's
    grad_clip: float = 0.5
    eval_windows: int = 64

    def check(self) -> None:
        super().check()
        if not 0 < self.decay <= 1:
            raise TrainError(f"--decay must be in (0, 1], got {self.decay}")


@dataclass
class HeadBatch:
    inputs: torch.Tensor  # [B, T, h] f_t
    targets: torch.Tensor  # [H, B, T, h] f_{t+1+i}: head i's label is the target's distribution from it
    masks: torch.Tensor  # [H, B, T] bool: position t has a label for head i (inside its chunk)


def gather_heads(fs: FeatureSet, windows: list[tuple[int, int]], num_heads: int, device: torch.device) -> HeadBatch:
    """Window (first, n) holds features first .. first + n of one chunk: head i at offset j needs
    feature first + j + 1 + i, so it has a label for j < n - i."""
    t = max(n for _, n in windows)
    offsets = torch.arange(t + num_heads)
    idx = torch.stack([first + offsets.clamp(max=n) for first, n in windows])  # padding repeats a valid row
    feats = fs.features[idx].to(device=device, dtype=torch.float32)  # [B, T + H, h]
    targets = torch.stack([feats[:, 1 + i : 1 + i + t] for i in range(num_heads)])
    masks = torch.stack([torch.stack([offsets[:t] < n - i for _, n in windows]) for i in range(num_heads)])
    return HeadBatch(feats[:, :t], targets, masks.to(device))


def medusa_loss(heads: MedusaHeads, head_t: torch.Tensor, batch: HeadBatch, decay: float,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    out = heads(batch.inputs)  # [H, B, T, h]
    total = torch.zeros((), device=batch.inputs.device)
    stats: dict[str, float] = {}
    for i in range(heads.cfg.num_heads):
        mask = batch.masks[i]
        if not mask.any():
            continue
        with torch.no_grad():
            p = torch.softmax(batch.targets[i][mask] @ head_t, dim=-1)
        logits = out[i][mask] @ head_t
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + decay**i * ce
        with torch.no_grad():
            stats[f"top1_{i}"] = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
        stats[f"ce_{i}"] = ce.item()
    stats["loss"] = total.item()
    stats["n"] = float(batch.masks[0].sum())
    return total, stats


class MedusaKind(DrafterKind[MedusaTrainArgs]):
    name = "medusa"
    format = FORMAT
    betas = BETAS
    reads = "Medusa trains on"
    count = "positions"
    heads: MedusaHeads
    head_t: torch.Tensor  # [h, V] float32: the frozen head shared by every Medusa head

    @property
    def min_pairs(self) -> int:
        return self.args.num_heads + 1  # a window must leave every head a label

    def build(self, model: FastLlama, fs: FeatureSet, vocab: torch.Tensor | None
              ) -> tuple[MedusaHeads, list[torch.nn.Parameter]]:
        args = self.args
        cfg = MedusaConfig(args.num_heads, args.num_layers, model.info.hidden_size, model.info.vocab_size,
                           draft_vocab_size=None if vocab is None else len(vocab))
        heads = MedusaHeads(cfg)  # the blocks' weights start at zero: each head starts near the identity
        head_t = draft_head_t(model, vocab).float()
        if heads.lm_head is not None:
            assert vocab is not None
            with torch.no_grad():
                heads.lm_head.weight.copy_(head_t.t())
                heads.draft_vocab.copy_(vocab)
            heads.lm_head.weight.requires_grad_(False)
        self.heads, self.head_t = heads.to(self.device).train(), head_t.to(self.device)
        return heads, [p for p in heads.parameters() if p.requires_grad]

    def loss(self, fs: FeatureSet, windows: list[Window], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        batch = gather_heads(fs, windows, self.args.num_heads, self.device)
        return medusa_loss(self.heads, self.head_t, batch, self.args.decay)

    def scores(self, fs: FeatureSet, windows: list[Window]) -> dict[str, float]:
        """Cross-entropy and top-1 agreement with the target, per head."""
        batch = gather_heads(fs, windows, self.args.num_heads, self.device)
        return medusa_loss(self.heads, self.head_t, batch, self.args.decay)[1]

    def report(self, train: dict[str, float] | None, scores: dict[str, float] | None) -> str:
        scores = scores or {}
        return "held out " + ", ".join(f"head {i} top1 {scores[f'top1_{i}']:.4f}"
                                       for i in range(self.args.num_heads) if f"top1_{i}" in scores)

    def save(self, out: Path, summary: dict[str, Any]) -> None:
        """Medusa's layout: config.json + medusa_lm_head.safetensors."""
        save_net(out, self.heads, summary, self.args.save_dtype)

    def card(self, record: dict[str, Any]) -> str:
        return render_card(record, self.args)


def train_medusa(args: MedusaTrainArgs, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) Medusa-1 heads under args.out; returns the training record."""
    return train(args, MedusaKind, log)


def _fmt_eval(ev: dict[str, float] | None, num_heads: int) -> str:
    if not ev:
        return "n/a"
    return "; ".join(f"head {i}: CE {ev[f'ce_{i}']:.4f}, top-1 {ev[f'top1_{i}']:.4f}"
                     for i in range(num_heads) if f"ce_{i}" in ev)


def render_card(record: dict[str, Any], args: MedusaTrainArgs) -> str:
    vocab, last = record["draft_vocab"], last_entry(record)
    return f"""# Medusa-1 heads for `{args.target}`

{args.num_heads} heads of {args.num_layers} residual block(s) on the target's final-norm hidden state;
head i proposes token t + 2 + i. Load them with

```yaml
drafters:
  - {{kind: medusa, name: medusa, path: {args.out}, draft_len: {args.num_heads}}}
```

{run_lines(record, args, f"({record['corpus']['features']})")}

{data_section(record)}

{windows_line(record, args, "positions")}

## Draft vocabulary and objective

{vocab['size']} token ids, covering **{vocab['coverage']:.2%}** of the corpus tokens; one shared head, the
target's lm_head rows for them, frozen. Loss: sum over heads of {args.decay}^i x cross-entropy against the
target's own distribution for that token (self-distillation). AdamW (betas {BETAS}), lr {args.lr},
{args.warmup_steps()} warmup steps, cosine decay, gradient clipping {args.grad_clip}, batch
{args.batch} x {args.seq_len}, seed {args.seed}.

## Results (held-out windows; top-1 = the head's argmax is the target's)

- Before training: {_fmt_eval(record.get('eval_initial'), args.num_heads)}
- After step {record['step']}: {_fmt_eval(last.get('eval'), args.num_heads)}

{mat_section()}"""
