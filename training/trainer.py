"""One training run for every drafter kind: check the settings, load the target, extract (or reuse)
its features, split off the held-out windows, build the kind's drafter, and step AdamW through a
cosine schedule with checkpoints that a resume continues exactly. A `DrafterKind` supplies what
is its own: the drafter, its loss and held-out scores, its files and card."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from training.args import TrainArgs, TrainError
from training.corpus import parse_sources
from training.data import HeldOut, Window, draft_vocab_of, held_out_split, target_features
from training.features import FeatureSet
from training.loop import Batcher, Checkpoint, batches, run_steps, weighted_means
from training.output import CARD_FILE, training_summary
from training.state import STATE_DIR, atomic_write_text, check_resume, load_state, record_checkpoint, resumed_record
from workers.config import ModelConfig
from workers.models.llama import FastLlama
from workers.target import LoadedModel, load_model

A = TypeVar("A", bound=TrainArgs)


class DrafterKind(ABC, Generic[A]):
    """What one kind of drafter adds to the shared run. An instance serves one run: `build` makes
    the drafter, the other methods train, score and write it."""

    name: ClassVar[str]  # the progress bar's label
    format: ClassVar[str]  # the "format" of the run's state.json and summary
    betas: ClassVar[tuple[float, float]]  # AdamW's
    reads: ClassVar[str]  # "EAGLE trains on": the refusal of a target without the fast Llama backend's features
    count: ClassVar[str]  # the held-out scores' name for the number of positions scored
    record_lr: ClassVar[bool] = False  # whether history entries carry the learning rate

    def __init__(self, args: A, device: torch.device) -> None:
        self.args, self.device = args, device

    @property
    def min_pairs(self) -> int:
        """Windows of fewer pairs are neither trained on nor scored."""
        return 1

    def prepare(self, loaded: LoadedModel) -> None:
        """Checks against the target, and what the kind takes from it, before features are extracted."""

    @abstractmethod
    def build(self, model: FastLlama, fs: FeatureSet, vocab: torch.Tensor | None
              ) -> tuple[nn.Module, list[nn.Parameter]]:
        """The drafter on the device, in training mode: (the module a checkpoint holds, the
        parameters AdamW updates). torch's generator is seeded with --seed just before."""

    def annotate(self, record: dict[str, Any]) -> None:
        """Facts of the kind's own added to the record, new or resumed."""

    @abstractmethod
    def loss(self, fs: FeatureSet, windows: list[Window], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective on one batch of windows at `step`, and its statistics ("loss" first)."""

    @abstractmethod
    def scores(self, fs: FeatureSet, windows: list[Window]) -> dict[str, float]:
        """Held-out statistics of one batch of windows, with their number of positions as "n"."""

    def evaluate(self, held: HeldOut) -> dict[str, float] | None:
        """The held-out statistics over every held-out window (None: there are none)."""
        if not held.windows:
            return None
        with torch.no_grad():
            return weighted_means((self.scores(held.fs, w) for w in batches(held.windows, self.args.batch)),
                                  self.count)

    @abstractmethod
    def report(self, train: dict[str, float] | None, scores: dict[str, float] | None) -> str:
        """A checkpoint's log line after "step N/STEPS: "."""

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record's gist for the drafter's config."""
        return training_summary(record, self.args)

    @abstractmethod
    def save(self, out: Path, summary: dict[str, Any]) -> None:
        """The drafter in its serving layout, the summary in its config."""

    @abstractmethod
    def card(self, record: dict[str, Any]) -> str:
        """The text of the drafter's CARD.md."""

    def write(self, out: Path, record: dict[str, Any]) -> None:
        self.save(out, self.summary(record))
        atomic_write_text(out / CARD_FILE, self.card(record))


def train_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: CUDA is not available")
    return device


def new_record(fmt: str, args: TrainArgs, fs: FeatureSet, held: HeldOut, train: list[Window],
               vocab: torch.Tensor | None, coverage: float, vocab_size: int,
               eval_initial: dict[str, float] | None) -> dict[str, Any]:
    """A new run's record: settings, corpus, windows (held out, trained on), draft vocabulary."""
    return {
        "format": fmt, "step": 0, "args": {**asdict(args), "resume": False}, "sessions": [args.command],
        "train_s": 0.0, "history": [],
        "corpus": {"sources": fs.meta.get("sources", {}), "tokens": fs.num_tokens,
                   "chunks": int(fs.bounds.shape[0] - 1),
                   "features": args.features or "extracted by this run",
                   "extract_s": fs.meta.get("extract_s"), "extract_tokens_per_s": fs.meta.get("tokens_per_s"),
                   "extract_device": fs.meta.get("device")},
        "windows": {"train": len(train), "held_out": len(held.windows), "seq_len": args.seq_len,
                    "held_out_from": held.source,
                    **({"held_out_sources": held.fs.meta.get("sources", {})} if held.fs is not fs else {})},
        "draft_vocab": {"size": vocab_size if vocab is None else len(vocab), "coverage": round(coverage, 6)},
        "eval_initial": eval_initial,
    }


def train(args: A, kind: type[DrafterKind[A]], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) a drafter of `kind`; writes it, CARD.md and train_state/ under args.out.
    Returns the training record (its summary also goes into the drafter's config)."""
    args.check()
    out = Path(args.out)
    state_dir = out / STATE_DIR
    saved = check_resume(out, args.resume, asdict(args), args.resume_must_match(), kind.format)
    if args.features is None:
        parse_sources(args.data)  # bad sources fail before the target loads
    drafter = kind(args, train_device(args.device))

    loaded = load_model(ModelConfig(model=args.target, device=args.device))
    model = loaded.model
    if not isinstance(model, FastLlama):
        raise TrainError(f"--target {args.target}: {drafter.reads} the fast Llama backend's features; "
                         "this architecture is not supported")
    drafter.prepare(loaded)
    fs = target_features(model, loaded.tokenizer, state_dir, data=args.data, max_tokens=args.max_tokens,
                         seed=args.seed, chunk_len=args.chunk_len, resume=args.resume, log=log, source=args.features)
    vocab, coverage = draft_vocab_of(fs, model, args.draft_vocab)

    torch.manual_seed(args.seed)  # any random initialization is reproducible
    module, params = drafter.build(model, fs, vocab)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=drafter.betas, weight_decay=args.weight_decay)
    held, train_windows = held_out_split(model, loaded.tokenizer, state_dir, fs, args, log)
    held.windows = [w for w in held.windows if w[1] >= drafter.min_pairs]
    train_windows = [w for w in train_windows if w[1] >= drafter.min_pairs]
    if not train_windows:
        raise TrainError(f"--data {args.data}: too little text to train on ({fs.num_tokens} tokens)")

    if saved is not None:
        load_state(state_dir, module, opt)
        record = resumed_record(saved, asdict(args), args.command)
    else:
        record = new_record(drafter.format, args, fs, held, train_windows, vocab, coverage, model.info.vocab_size,
                            drafter.evaluate(held))
    drafter.annotate(record)

    start, stop = record["step"], min(args.steps, args.stop_at or args.steps)
    if start >= stop:
        log(f"the run is at step {start} already; --steps {args.steps} leaves nothing to train")
    batcher = Batcher(train_windows, args.batch, args.seed)

    def on_checkpoint(cp: Checkpoint) -> None:
        entry: dict[str, Any] = {"step": cp.step}
        if drafter.record_lr:
            entry["lr"] = args.lr_at(cp.step - 1)
        entry["epoch"] = round(batcher.epoch_of(cp.step), 4)
        if cp.train:
            entry["train"] = cp.train
        entry["eval"] = drafter.evaluate(held)
        record_checkpoint(record, entry, cp.train_s, state_dir, module, opt)
        drafter.write(out, record)
        log(f"step {cp.step}/{args.steps}: {drafter.report(cp.train, entry['eval'])}")

    run_steps(opt, params, start=start, stop=stop, save_every=args.save_every, grad_clip=args.grad_clip,
              desc=drafter.name, lr_at=args.lr_at, loss_at=lambda step: drafter.loss(fs, batcher.at(step), step),
              on_checkpoint=on_checkpoint, final=not (out / "config.json").is_file())
    return record
