"""The distilled drafter model kind (`specroute train-drafter --kind model`).

The student is the target's own architecture with `num_layers` decoder layers, started from the
target's layers `init_layers` (by default the first ones and the last: the last layer writes into
the space the lm_head reads) and its final norm. It shares the target's embeddings and lm_head,
frozen, and reads tokens only (no target features at drafting time, unlike EAGLE and Medusa), so
it drafts for any backend and also serves transformers' assisted generation.

Objective: at each corpus position, the target's next-token distribution there, softmax(f_t @
lm_head) from the target's features (training/features.py, or `--features` of another run),
against the student's; forward KL over the draft vocabulary (DistillSpec's choice for greedy
acceptance). The draft vocabulary is also what the `model` drafter computes logits for.

Output: a Hugging Face Llama directory (config.json, model.safetensors, generation config,
tokenizer) without the embeddings, which are the target's (workers/target.py), plus
draft_vocab.safetensors and CARD.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from training.args import SAVE_DTYPES, TrainArgs, TrainError
from training.data import HeldOut, Window, draft_head_t
from training.features import FeatureSet
from training.output import (
    SUMMARY_KEYS,
    data_section,
    last_entry,
    mat_section,
    run_lines,
    training_summary,
    windows_line,
)
from training.trainer import DrafterKind, train
from workers.config import ModelConfig
from workers.models.llama import FastLlama
from workers.target import DRAFT_VOCAB_FILE, SHARED_EMBEDDINGS_KEY, WEIGHTS_FILE, LoadedModel, load_hf

FORMAT = "specroute-model-train/1"
BETAS = (0.9, 0.95)
# the record's keys in the drafter's summary: the shared ones and the layers the student started from
MODEL_SUMMARY_KEYS = (*SUMMARY_KEYS[:3], "init_layers", *SUMMARY_KEYS[3:])


@dataclass(frozen=True, kw_only=True)
class ModelTrainArgs(TrainArgs):
    num_layers: int = 2
    init_layers: str | None = None  # comma list of the target's layers to start from; None: first ones + last
    positive: ClassVar[tuple[str, ...]] = ("max_tokens", "chunk_len", "num_layers", "steps", "batch", "seq_len",
                                           "save_every")
    # the model's defaults of the shared settings
    batch: int = 4
    seq_len: int = 512
    lr: float = 2e-4
    grad_clip: float = 1.0
    eval_windows: int = 32

    def check(self) -> None:
        super().check()
        parse_layers(self.init_layers, self.num_layers)


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


class ModelKind(DrafterKind[ModelTrainArgs]):
    name = "model"
    format = FORMAT
    betas = BETAS
    reads = "distillation reads"
    count = "positions"
    layers: list[int]  # the target layers the student starts from
    tokenizer: Any  # the target's, saved with the drafter
    student: PreTrainedModel
    head_t: torch.Tensor  # [h, V] float32: the target's lm_head over the draft vocabulary
    vocab: torch.Tensor | None
    _target_hf: PreTrainedModel | None = None  # the target in transformers, until the student is built

    def prepare(self, loaded: LoadedModel) -> None:
        self.tokenizer = loaded.tokenizer
        self._target_hf, _, _ = load_hf(ModelConfig(model=self.args.target, device="cpu", dtype="float32"))
        self.layers = init_layers(self.args.init_layers, self.args.num_layers,
                                  self._target_hf.config.num_hidden_layers)

    def build(self, model: FastLlama, fs: FeatureSet, vocab: torch.Tensor | None
              ) -> tuple[Trainable, list[nn.Parameter]]:
        assert self._target_hf is not None
        self.head_t = draft_head_t(model, vocab).float().to(self.device)
        self.student = student_from_target(self._target_hf, self.layers).to(self.device).train()
        self._target_hf, self.vocab = None, vocab
        trainable = Trainable(self.student)
        return trainable, [p for p in trainable.parameters() if p.requires_grad]

    def annotate(self, record: dict[str, Any]) -> None:
        record["init_layers"] = self.layers

    def loss(self, fs: FeatureSet, windows: list[Window], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return distill_loss(self.student, self.head_t, gather_tokens(fs, windows, self.device))

    def scores(self, fs: FeatureSet, windows: list[Window]) -> dict[str, float]:
        """KL and top-1 agreement with the target (the student's argmax is the target's)."""
        return self.loss(fs, windows, 0)[1]

    def evaluate(self, held: HeldOut) -> dict[str, float] | None:
        was_training = self.student.training
        self.student.eval()
        scores = super().evaluate(held)
        self.student.train(was_training)
        return scores

    def report(self, train: dict[str, float] | None, scores: dict[str, float] | None) -> str:
        scores = scores or {}
        return (f"held out KL {scores.get('loss', float('nan')):.4f}, "
                f"top-1 agreement {scores.get('top1', float('nan')):.4f}")

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        return training_summary(record, self.args, MODEL_SUMMARY_KEYS)

    def save(self, out: Path, summary: dict[str, Any]) -> None:
        """A Hugging Face Llama directory without the (shared) embeddings, and the draft vocabulary."""
        args, student = self.args, self.student
        out.mkdir(parents=True, exist_ok=True)
        dtype = SAVE_DTYPES[args.save_dtype]
        shared = {"model.embed_tokens.weight", "lm_head.weight"}
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in student.state_dict().items()
                   if k not in shared}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        if self.vocab is not None:
            save_file({"draft_vocab": self.vocab.cpu().contiguous()}, str(out / DRAFT_VOCAB_FILE))
        cfg = copy.deepcopy(student.config)
        setattr(cfg, SHARED_EMBEDDINGS_KEY, True)
        cfg.dtype = args.save_dtype
        cfg.specroute_training = summary
        cfg.save_pretrained(out)
        student.generation_config.save_pretrained(out)
        self.tokenizer.save_pretrained(out)

    def card(self, record: dict[str, Any]) -> str:
        return render_card(record, self.args)


def train_model(args: ModelTrainArgs, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) a distilled drafter model under args.out; returns the training record."""
    return train(args, ModelKind, log)


def _fmt_eval(ev: dict[str, float] | None) -> str:
    return f"KL {ev['loss']:.4f}, top-1 agreement {ev['top1']:.4f}" if ev else "n/a"


def render_card(record: dict[str, Any], args: ModelTrainArgs) -> str:
    vocab, last = record["draft_vocab"], last_entry(record)
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

{run_lines(record, args, f"({record['corpus']['features']})")}

{data_section(record)}

{windows_line(record, args, "positions")}

## Draft vocabulary and objective

{vocab['size']} token ids (draft_vocab.safetensors), covering **{vocab['coverage']:.2%}** of the corpus
tokens: the drafter computes logits for these only. Loss: KL(target || student) over them at every
position. AdamW (betas {BETAS}), lr {args.lr}, {args.warmup_steps()} warmup steps, cosine decay,
gradient clipping {args.grad_clip}, batch {args.batch} x {args.seq_len}, seed {args.seed}.

## Results (held-out windows; top-1 agreement = the student's argmax is the target's)

- Before training: {_fmt_eval(record.get('eval_initial'))}
- After step {record['step']}: {_fmt_eval(last.get('eval'))}

{mat_section()}"""
