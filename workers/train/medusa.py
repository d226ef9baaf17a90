"""Training Medusa-1 heads on the frozen target (`specroute train-drafter --kind medusa`).

Head i reads the target's final-norm feature f_t and proposes token t + 2 + i (the target's own
head gives t + 1; workers/drafters/medusa.py drafts the same way). The label is the target's own
distribution for that token, softmax(f_{t+1+i} @ lm_head) over the draft vocabulary (self-
distillation: what the target would verify, also on text the target did not write). Loss:
sum_i decay^i * CE_i (Medusa's 0.8^i weighting). Heads are Medusa's residual blocks, starting as
the identity (zero weights: every head starts as the target's next-token guess); they share one
frozen head, the target's lm_head rows of the draft vocabulary.

Features come from the corpus by teacher forcing (workers/train/features.py), or from an earlier
run's features file (`--features`, e.g. an EAGLE run's train_state/features.safetensors: the
same target, so the same numbers). Resumable like the EAGLE trainer (workers/train/common.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from workers.config import ModelConfig
from workers.drafters.medusa import MedusaConfig, MedusaHeads
from workers.models.llama import FastLlama
from workers.target import load_model
from workers.train.common import (
    CARD_FILE,
    SAVE_DTYPES,
    SPEC_BENCH_CATEGORIES,
    STATE_DIR,
    Batcher,
    Checkpoint,
    TrainError,
    atomic_write_text,
    check_common_args,
    check_resume,
    cosine_lr,
    draft_vocab_of,
    held_out_note,
    held_out_split,
    load_state,
    new_record,
    record_checkpoint,
    resumed_record,
    run_steps,
    target_features,
    train_device,
    warmup_steps,
)
from workers.train.corpus import parse_sources
from workers.train.features import FeatureSet

FORMAT = "specroute-medusa-train/1"
BETAS = (0.9, 0.999)


@dataclass(frozen=True)
class MedusaTrainArgs:
    target: str
    data: str
    out: str
    features: str | None = None  # an earlier run's features file instead of running the target
    max_tokens: int = 1_000_000
    draft_vocab: int = 8192  # 0: the target's full vocabulary
    chunk_len: int = 512
    num_heads: int = 3
    num_layers: int = 1
    steps: int = 2000
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3  # Medusa-1's
    warmup: int | None = None  # None: 5% of steps (1 .. 1000)
    weight_decay: float = 0.0
    decay: float = 0.8  # head i's loss weight: decay ** i
    grad_clip: float = 0.5
    seed: int = 0
    device: str = "cpu"
    save_every: int = 500
    stop_at: int | None = None
    eval_windows: int = 64
    eval_data: str | None = None  # sources of separate held-out text (default: a share of --data's windows)
    save_dtype: str = "float32"
    resume: bool = False
    command: str = ""

    def warmup_steps(self) -> int:
        return warmup_steps(self.warmup, self.steps)


RESUME_MUST_MATCH = ("target", "data", "features", "max_tokens", "draft_vocab", "chunk_len", "num_heads", "num_layers",
                     "batch", "seq_len", "lr", "warmup", "weight_decay", "decay", "grad_clip", "seed", "eval_windows",
                     "eval_data")


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


@torch.no_grad()
def evaluate(heads: MedusaHeads, head_t: torch.Tensor, fs: FeatureSet, windows: list, args: MedusaTrainArgs,
             device: torch.device) -> dict[str, float] | None:
    """Cross-entropy and top-1 agreement with the target, per head, on held-out windows."""
    if not windows:
        return None
    sums: dict[str, float] = {}
    total = 0.0
    for i in range(0, len(windows), args.batch):
        _, stats = medusa_loss(heads, head_t, gather_heads(fs, windows[i : i + args.batch], args.num_heads, device),
                               args.decay)
        for k, v in stats.items():
            if k != "n":
                sums[k] = sums.get(k, 0.0) + v * stats["n"]
        total += stats["n"]
    return {k: round(v / total, 6) for k, v in sums.items()} | {"positions": int(total)}


def _check_args(args: MedusaTrainArgs) -> None:
    check_common_args(args, ("max_tokens", "chunk_len", "num_heads", "num_layers", "steps", "batch", "seq_len",
                             "save_every"))
    if not 0 < args.decay <= 1:
        raise TrainError(f"--decay must be in (0, 1], got {args.decay}")


def train_medusa(args: MedusaTrainArgs, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) Medusa-1 heads; writes them (Medusa's layout), CARD.md and train_state/
    under args.out. Returns the training record."""
    _check_args(args)
    out = Path(args.out)
    state_dir = out / STATE_DIR
    saved = check_resume(out, args.resume, asdict(args), RESUME_MUST_MATCH)
    if args.features is None:
        parse_sources(args.data)  # bad sources fail before the target loads
    device = train_device(args.device)
    loaded = load_model(ModelConfig(model=args.target, device=args.device))
    model = loaded.model
    if not isinstance(model, FastLlama):
        raise TrainError(f"--target {args.target}: Medusa trains on the fast Llama backend's features; "
                         "this architecture is not supported")
    fs = target_features(model, loaded.tokenizer, state_dir, data=args.data, max_tokens=args.max_tokens,
                         seed=args.seed, chunk_len=args.chunk_len, resume=args.resume, log=log, source=args.features)

    vocab_size = model.info.vocab_size
    vocab, coverage = draft_vocab_of(fs, model, args.draft_vocab)
    cfg = MedusaConfig(args.num_heads, args.num_layers, model.info.hidden_size, vocab_size,
                       draft_vocab_size=None if vocab is None else len(vocab))
    torch.manual_seed(args.seed)  # the blocks' biases: torch's default initialization, reproducible
    heads = MedusaHeads(cfg)  # the blocks' weights start at zero: each head starts near the identity
    head_t = (model.lm_head.w_t if vocab is None else model.lm_head.w_t[:, vocab.to(model.device)]).float()
    if heads.lm_head is not None:
        assert vocab is not None
        with torch.no_grad():
            heads.lm_head.weight.copy_(head_t.t())
            heads.draft_vocab.copy_(vocab)
        heads.lm_head.weight.requires_grad_(False)
    heads.to(device)
    head_t = head_t.to(device)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, weight_decay=args.weight_decay)
    held, train_windows = held_out_split(model, loaded.tokenizer, state_dir, fs, args, log)
    # a window must leave every head a label: at least num_heads pairs
    train_windows = [w for w in train_windows if w[1] > args.num_heads]
    held.windows = [w for w in held.windows if w[1] > args.num_heads]
    if not train_windows:
        raise TrainError(f"--data {args.data}: too little text to train on ({fs.num_tokens} tokens)")

    if saved is not None:
        load_state(state_dir, heads, opt)
        record = resumed_record(saved, asdict(args), args.command)
    else:
        record = new_record(FORMAT, args, fs, held, train_windows, vocab, coverage, vocab_size,
                            evaluate(heads, head_t, held.fs, held.windows, args, device))

    start_step, stop = record["step"], min(args.steps, args.stop_at or args.steps)
    batcher = Batcher(train_windows, args.batch, args.seed)

    def on_checkpoint(cp: Checkpoint) -> None:
        entry: dict[str, Any] = {"step": cp.step, "epoch": round(batcher.epoch_of(cp.step), 4)}
        if cp.train:
            entry["train"] = cp.train
        entry["eval"] = evaluate(heads, head_t, held.fs, held.windows, args, device)
        record_checkpoint(record, entry, cp.train_s, state_dir, heads, opt)
        write_heads(out, heads, record, args)
        scores = entry["eval"] or {}
        log(f"step {cp.step}/{args.steps}: held out " + ", ".join(
            f"head {i} top1 {scores[f'top1_{i}']:.4f}" for i in range(args.num_heads) if f"top1_{i}" in scores))

    heads.train()
    run_steps(opt, params, start=start_step, stop=stop, save_every=args.save_every, grad_clip=args.grad_clip,
              desc="medusa", lr_at=lambda step: cosine_lr(step, args.lr, args.steps, args.warmup_steps()),
              loss_at=lambda step: medusa_loss(heads, head_t, gather_heads(fs, batcher.at(step), args.num_heads,
                                                                              device), args.decay),
              on_checkpoint=on_checkpoint, final=not (out / "config.json").is_file())
    return record


def write_heads(out: Path, heads: MedusaHeads, record: dict[str, Any], args: MedusaTrainArgs) -> None:
    """The heads in Medusa's layout (config.json + medusa_lm_head.safetensors) and CARD.md."""
    cpu = copy.deepcopy(heads).to("cpu")
    cpu.to(SAVE_DTYPES[args.save_dtype])  # floating tensors only: draft_vocab stays int64
    summary = {k: record[k] for k in ("format", "step", "train_s", "corpus", "windows", "draft_vocab", "eval_initial")}
    summary |= {"steps": args.steps, "eval_final": record["history"][-1]["eval"] if record["history"] else None,
                "target": args.target, "data": args.data, "sessions": record["sessions"]}
    cpu.save(out, extra_config={"specroute_training": summary})
    atomic_write_text(out / CARD_FILE, render_card(record, args))


def _fmt_eval(ev: dict[str, float] | None, num_heads: int) -> str:
    if not ev:
        return "n/a"
    return "; ".join(f"head {i}: CE {ev[f'ce_{i}']:.4f}, top-1 {ev[f'top1_{i}']:.4f}"
                     for i in range(num_heads) if f"ce_{i}" in ev)


def render_card(record: dict[str, Any], args: MedusaTrainArgs) -> str:
    corpus, vocab = record["corpus"], record["draft_vocab"]
    last = record["history"][-1] if record["history"] else {}
    sources = "\n".join(f"| `{label}` | {s['documents']} | {s['tokens']} |" for label, s in corpus["sources"].items())
    categories = "\n".join(f"| {c} | | | |" for c in SPEC_BENCH_CATEGORIES)
    status = "complete" if record["step"] >= args.steps else f"partial: step {record['step']} of {args.steps}"
    sessions = "\n".join(f"  - `{c}`" for c in record["sessions"])
    return f"""# Medusa-1 heads for `{args.target}`

{args.num_heads} heads of {args.num_layers} residual block(s) on the target's final-norm hidden state;
head i proposes token t + 2 + i. Load them with

```yaml
drafters:
  - {{kind: medusa, name: medusa, path: {args.out}, draft_len: {args.num_heads}}}
```

- Status: {status} ({record['updated']})
- Commands (one per session; `--resume` continues):
{sessions}
- Training time: {record['train_s']:.1f} s of steps over {record['step']} steps; features: {corpus['tokens']} tokens
  ({corpus['features']})

## Data (never Spec-Bench's held-out split)

| source | documents | tokens |
|---|---|---|
{sources}

Training windows of at most {args.seq_len} positions: {record['windows']['train']} trained on,
{held_out_note(record)}

## Draft vocabulary and objective

{vocab['size']} token ids, covering **{vocab['coverage']:.2%}** of the corpus tokens; one shared head, the
target's lm_head rows for them, frozen. Loss: sum over heads of {args.decay}^i x cross-entropy against the
target's own distribution for that token (self-distillation). AdamW (betas {BETAS}), lr {args.lr},
{args.warmup_steps()} warmup steps, cosine decay, gradient clipping {args.grad_clip}, batch
{args.batch} x {args.seq_len}, seed {args.seed}.

## Results (held-out windows; top-1 = the head's argmax is the target's)

- Before training: {_fmt_eval(record.get('eval_initial'), args.num_heads)}
- After step {record['step']}: {_fmt_eval(last.get('eval'), args.num_heads)}

## Mean accepted tokens per step (MAT) on Spec-Bench, greedy

| category | MAT | k | prompts |
|---|---|---|---|
{categories}
"""
