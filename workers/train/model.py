"""Distilling a small drafter model from the target (`specroute train-drafter --kind model`).

The student is the target's own architecture with `num_layers` decoder layers, started from the
target's layers `init_layers` (by default the first ones and the last: the last layer writes into
the space the lm_head reads) and its final norm. It shares the target's embeddings and lm_head,
frozen, and reads tokens only (no target features at drafting time, unlike EAGLE and Medusa), so
it drafts for any backend and also serves transformers' assisted generation.

Objective: at each corpus position, the target's next-token distribution there, softmax(f_t @
lm_head) from the target's features (workers/train/features.py, or `--features` of another run),
against the student's; forward KL over the draft vocabulary (DistillSpec's choice for greedy
acceptance). The draft vocabulary is also what the `model` drafter computes logits for.

Output: a Hugging Face Llama directory (config.json, model.safetensors, generation config,
tokenizer) without the embeddings, which are the target's (workers/target.py), plus
draft_vocab.safetensors and CARD.md. Resumable like the other trainers (workers/train/common.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from workers.config import ModelConfig
from workers.models.llama import FastLlama
from workers.target import DRAFT_VOCAB_FILE, SHARED_EMBEDDINGS_KEY, WEIGHTS_FILE, load_hf, load_model
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

FORMAT = "specroute-model-train/1"
BETAS = (0.9, 0.95)


@dataclass(frozen=True)
class ModelTrainArgs:
    target: str
    data: str
    out: str
    features: str | None = None  # an earlier run's features file instead of running the target
    max_tokens: int = 1_000_000
    draft_vocab: int = 8192  # 0: the target's full vocabulary
    chunk_len: int = 512
    num_layers: int = 2
    init_layers: str | None = None  # comma list of the target's layers to start from; None: first ones + last
    steps: int = 2000
    batch: int = 4
    seq_len: int = 512
    lr: float = 2e-4
    warmup: int | None = None  # None: 5% of steps (1 .. 1000)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    save_every: int = 500
    stop_at: int | None = None
    eval_windows: int = 32
    eval_data: str | None = None  # sources of separate held-out text (default: a share of --data's windows)
    save_dtype: str = "float32"
    resume: bool = False
    command: str = ""

    def warmup_steps(self) -> int:
        return warmup_steps(self.warmup, self.steps)


RESUME_MUST_MATCH = ("target", "data", "features", "max_tokens", "draft_vocab", "chunk_len", "num_layers",
                     "init_layers", "batch", "seq_len", "lr", "warmup", "weight_decay", "grad_clip", "seed",
                     "eval_windows", "eval_data")


def parse_layers(spec: str | None, num_layers: int) -> list[int] | None:
    """--init-layers as a list (None: the default)."""
    if spec is None:
        return None
    try:
        layers = [int(x) for x in spec.split(",")]
    except ValueError:
        raise TrainError(f"--init-layers: a comma list of layer numbers, got {spec!r}") from None
    if len(layers) != num_layers:
        raise TrainError(f"--init-layers names {len(layers)} layers, --num-layers is {num_layers}")
    return layers


def init_layers(spec: str | None, num_layers: int, target_layers: int) -> list[int]:
    """The target layers the student starts from: `spec` or the first num_layers - 1 and the last."""
    layers = parse_layers(spec, num_layers) or [*range(num_layers - 1), target_layers - 1]
    if bad := [i for i in layers if not 0 <= i < target_layers]:
        raise TrainError(f"--init-layers: {bad} not in 0..{target_layers - 1} (the target has {target_layers} layers)")
    return layers


def student_from_target(target: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """The target's architecture with `layers` of its decoder layers (copied) and its final norm;
    the embeddings (and the tied lm_head) are the target's own tensor, frozen."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = True
    if getattr(cfg, "layer_types", None):  # per-layer attention kinds follow the layers chosen
        cfg.layer_types = [target.config.layer_types[i] for i in layers]
    student = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    src = target.state_dict()
    state = {f"model.layers.{j}.{k.split('.', 3)[3]}": v for j, i in enumerate(layers)
             for k, v in src.items() if k.startswith(f"model.layers.{i}.")}
    state["model.norm.weight"] = src["model.norm.weight"]
    missing, unexpected = student.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"model.embed_tokens.weight", "lm_head.weight"}, (missing, unexpected)
    shared = nn.Parameter(target.get_input_embeddings().weight.detach().float(), requires_grad=False)
    student.get_input_embeddings().weight = shared
    student.get_output_embeddings().weight = shared
    return student


class Trainable(nn.Module):
    """The student's trained parts (its layers and final norm), as one module for checkpoints."""

    def __init__(self, student: PreTrainedModel) -> None:
        super().__init__()
        self.layers = student.model.layers
        self.norm = student.model.norm


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] tokens t of each window
    features: torch.Tensor  # [B, T, h] the target's feature at each: its next-token distribution
    mask: torch.Tensor  # [B, T] bool: a real position (windows shorter than T are padded at the end)


def gather_tokens(fs: FeatureSet, windows: list[tuple[int, int]], device: torch.device) -> TokenBatch:
    """Window (first, n): tokens first .. first + n - 1 with their features (the target's
    distribution for the token after each)."""
    t = max(n for _, n in windows)
    offsets = torch.arange(t)
    idx = torch.stack([first + offsets.clamp(max=n - 1) for first, n in windows])  # padding repeats a real row
    mask = torch.stack([offsets < n for _, n in windows])
    return TokenBatch(fs.ids[idx].to(device), fs.features[idx].to(device=device, dtype=torch.float32), mask.to(device))


def distill_loss(
    student: PreTrainedModel, head_t: torch.Tensor, batch: TokenBatch,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL(target || student) over the draft vocabulary, per real position."""
    hidden = student.model(input_ids=batch.input_ids).last_hidden_state[batch.mask]  # [N, h], after the final norm
    logq = torch.log_softmax(hidden @ head_t, dim=-1)
    with torch.no_grad():
        logp = torch.log_softmax(batch.features[batch.mask] @ head_t, dim=-1)
        p = logp.exp()
    kl = (p * (logp - logq)).sum(-1).mean()
    with torch.no_grad():
        top1 = (logq.argmax(-1) == logp.argmax(-1)).float().mean().item()
    return kl, {"loss": kl.item(), "top1": top1, "n": float(batch.mask.sum())}


@torch.no_grad()
def evaluate(student: PreTrainedModel, head_t: torch.Tensor, fs: FeatureSet, windows: list, batch: int,
             device: torch.device) -> dict[str, float] | None:
    """KL and top-1 agreement with the target (the student's argmax is the target's) on held-out windows."""
    if not windows:
        return None
    was_training = student.training
    student.eval()
    sums, total = {"loss": 0.0, "top1": 0.0}, 0.0
    for i in range(0, len(windows), batch):
        _, stats = distill_loss(student, head_t, gather_tokens(fs, windows[i : i + batch], device))
        for k in sums:
            sums[k] += stats[k] * stats["n"]
        total += stats["n"]
    student.train(was_training)
    return {k: round(v / total, 6) for k, v in sums.items()} | {"positions": int(total)}


def _check_args(args: ModelTrainArgs) -> None:
    check_common_args(args, ("max_tokens", "chunk_len", "num_layers", "steps", "batch", "seq_len", "save_every"))
    parse_layers(args.init_layers, args.num_layers)


def train_model(args: ModelTrainArgs, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) a distilled drafter model; writes it (a Hugging Face directory sharing the
    target's embeddings), CARD.md and train_state/ under args.out. Returns the training record."""
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
        raise TrainError(f"--target {args.target}: distillation reads the fast Llama backend's features; "
                         "this architecture is not supported")
    target_hf, _, _ = load_hf(ModelConfig(model=args.target, device="cpu", dtype="float32"))
    layers = init_layers(args.init_layers, args.num_layers, target_hf.config.num_hidden_layers)
    fs = target_features(model, loaded.tokenizer, state_dir, data=args.data, max_tokens=args.max_tokens,
                         seed=args.seed, chunk_len=args.chunk_len, resume=args.resume, log=log, source=args.features)

    vocab, coverage = draft_vocab_of(fs, model, args.draft_vocab)
    head_t = (model.lm_head.w_t if vocab is None else model.lm_head.w_t[:, vocab.to(model.device)]).float().to(device)

    student = student_from_target(target_hf, layers).to(device)
    del target_hf
    trainable = Trainable(student)
    params = [p for p in trainable.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, weight_decay=args.weight_decay)
    held, train_windows = held_out_split(model, loaded.tokenizer, state_dir, fs, args, log)
    if not train_windows:
        raise TrainError(f"--data {args.data}: too little text to train on ({fs.num_tokens} tokens)")

    if saved is not None:
        load_state(state_dir, trainable, opt)
        record = resumed_record(saved, asdict(args), args.command)
    else:
        record = new_record(FORMAT, args, fs, held, train_windows, vocab, coverage, model.info.vocab_size,
                            evaluate(student, head_t, held.fs, held.windows, args.batch, device))
        record["init_layers"] = layers

    start_step, stop = record["step"], min(args.steps, args.stop_at or args.steps)
    batcher = Batcher(train_windows, args.batch, args.seed)

    def on_checkpoint(cp: Checkpoint) -> None:
        entry: dict[str, Any] = {"step": cp.step, "epoch": round(batcher.epoch_of(cp.step), 4)}
        if cp.train:
            entry["train"] = cp.train
        entry["eval"] = evaluate(student, head_t, held.fs, held.windows, args.batch, device)
        record_checkpoint(record, entry, cp.train_s, state_dir, trainable, opt)
        write_drafter(out, student, vocab, record, args, loaded.tokenizer)
        scores = entry["eval"] or {}
        log(f"step {cp.step}/{args.steps}: held out KL {scores.get('loss', float('nan')):.4f}, "
            f"top-1 agreement {scores.get('top1', float('nan')):.4f}")

    student.train()
    run_steps(opt, params, start=start_step, stop=stop, save_every=args.save_every, grad_clip=args.grad_clip,
              desc="model", lr_at=lambda step: cosine_lr(step, args.lr, args.steps, args.warmup_steps()),
              loss_at=lambda step: distill_loss(student, head_t, gather_tokens(fs, batcher.at(step), device)),
              on_checkpoint=on_checkpoint, final=not (out / "config.json").is_file())
    return record


def write_drafter(out: Path, student: PreTrainedModel, vocab: torch.Tensor | None, record: dict[str, Any],
                  args: ModelTrainArgs, tokenizer: Any) -> None:
    """A Hugging Face Llama directory without the (shared) embeddings, the draft vocabulary, CARD.md."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = SAVE_DTYPES[args.save_dtype]
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in student.state_dict().items() if k not in shared}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if vocab is not None:
        save_file({"draft_vocab": vocab.cpu().contiguous()}, str(out / DRAFT_VOCAB_FILE))
    cfg = copy.deepcopy(student.config)
    setattr(cfg, SHARED_EMBEDDINGS_KEY, True)
    cfg.dtype = args.save_dtype
    summary = {k: record[k] for k in ("format", "step", "train_s", "init_layers", "corpus", "windows", "draft_vocab",
                                      "eval_initial")}
    summary |= {"steps": args.steps, "eval_final": record["history"][-1]["eval"] if record["history"] else None,
                "target": args.target, "data": args.data, "sessions": record["sessions"]}
    cfg.specroute_training = summary
    cfg.save_pretrained(out)
    student.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    atomic_write_text(out / CARD_FILE, render_card(record, args))


def _fmt_eval(ev: dict[str, float] | None) -> str:
    return f"KL {ev['loss']:.4f}, top-1 agreement {ev['top1']:.4f}" if ev else "n/a"


def render_card(record: dict[str, Any], args: ModelTrainArgs) -> str:
    corpus, vocab = record["corpus"], record["draft_vocab"]
    last = record["history"][-1] if record["history"] else {}
    sources = "\n".join(f"| `{label}` | {s['documents']} | {s['tokens']} |" for label, s in corpus["sources"].items())
    categories = "\n".join(f"| {c} | | | |" for c in SPEC_BENCH_CATEGORIES)
    status = "complete" if record["step"] >= args.steps else f"partial: step {record['step']} of {args.steps}"
    sessions = "\n".join(f"  - `{c}`" for c in record["sessions"])
    return f"""# Distilled drafter model for `{args.target}`

A {args.num_layers}-layer model of the target's architecture, started from the target's layers
{record['init_layers']} and distilled on the target's next-token distributions. It shares the target's
embeddings and lm_head (not stored here). Load it with

```yaml
drafters:
  - {{kind: model, name: model, model: {{model: {args.out}}}, draft_len: 3}}
```

In transformers (e.g. as `assistant_model`), give it the target's embeddings first:
`workers.target.load_hf(ModelConfig(model="{args.out}"), target.get_input_embeddings().weight)`.

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

{vocab['size']} token ids (draft_vocab.safetensors), covering **{vocab['coverage']:.2%}** of the corpus
tokens: the drafter computes logits for these only. Loss: KL(target || student) over them at every
position. AdamW (betas {BETAS}), lr {args.lr}, {args.warmup_steps()} warmup steps, cosine decay,
gradient clipping {args.grad_clip}, batch {args.batch} x {args.seq_len}, seed {args.seed}.

## Results (held-out windows; top-1 agreement = the student's argmax is the target's)

- Before training: {_fmt_eval(record.get('eval_initial'))}
- After step {record['step']}: {_fmt_eval(last.get('eval'))}

## Mean accepted tokens per step (MAT) on Spec-Bench, greedy

| category | MAT | k | prompts |
|---|---|---|---|
{categories}
"""
