"""What every drafter trainer shares: the run's files, resumable state without pickle, the
learning-rate schedule, and a data order that is a function of the step (so a resumed run
repeats the uninterrupted one exactly)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from workers.models.llama import FastLlama
from workers.train.corpus import build_corpus, parse_sources
from workers.train.features import FeatureSet, chunk_documents, extract_features, select_draft_vocab, vocab_coverage

STATE_DIR = "train_state"
STATE_TENSORS = "state.safetensors"
STATE_JSON = "state.json"
FEATURES_FILE = "features.safetensors"
EVAL_FEATURES_FILE = "eval_features.safetensors"  # --eval-data's corpus, teacher forced like the training one
SHARE_OF_CORPUS = "a random share of the corpus's windows"  # where held-out windows come from by default
CARD_FILE = "CARD.md"
MIN_LR_RATIO = 0.1  # cosine decay ends at lr * this
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")


class TrainError(ValueError):
    """A user error in the training settings or state; the message names the setting or file."""


def warmup_steps(warmup: int | None, steps: int) -> int:
    """--warmup, or by default 5% of the steps (1 .. 1000)."""
    return warmup if warmup is not None else max(1, min(1000, round(0.05 * steps)))


def cosine_lr(step: int, lr: float, steps: int, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to MIN_LR_RATIO * lr at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: CUDA is not available")
    return device


def split_windows(windows: list[tuple[int, int]], eval_windows: int, seed: int) -> tuple[list, list]:
    """(held out, train): at most eval_windows and a tenth of all are held out, chosen by the seed."""
    n_eval = min(eval_windows, len(windows) // 10) if eval_windows > 0 else 0
    if eval_windows > 0 and n_eval == 0 and len(windows) >= 2:
        n_eval = 1
    perm = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(perm[:n_eval])
    return ([w for i, w in enumerate(windows) if i in held], [w for i, w in enumerate(windows) if i not in held])


class Batcher:
    """Sample i of the run is window perm_epoch[i mod n], epoch = i // n: a function of the step."""

    def __init__(self, windows: list[tuple[int, int]], batch: int, seed: int) -> None:
        self.windows, self.batch, self.seed = windows, batch, seed
        self._epoch, self._perm = -1, []

    def at(self, step: int) -> list[tuple[int, int]]:
        out = []
        for i in range(step * self.batch, (step + 1) * self.batch):
            epoch, j = divmod(i, len(self.windows))
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch + 1)
                self._epoch, self._perm = epoch, torch.randperm(len(self.windows), generator=g).tolist()
            out.append(self.windows[self._perm[j]])
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.batch / len(self.windows)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save_state(state_dir: Path, net: torch.nn.Module, opt: torch.optim.Optimizer, record: dict[str, Any]) -> None:
    """Model + AdamW state as safetensors, the rest as JSON (written last: it commits the checkpoint)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    sd = opt.state_dict()
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    for i, st in sd["state"].items():
        tensors |= {f"optim.{i}.{k}": torch.as_tensor(v).detach().cpu().contiguous() for k, v in st.items()}
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in sd["param_groups"]]
    tmp = state_dir / (STATE_TENSORS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(state_dir / STATE_TENSORS)
    atomic_write_text(state_dir / STATE_JSON, json.dumps({**record, "param_groups": groups}, indent=1) + "\n")


def load_state(state_dir: Path, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    record = json.loads((state_dir / STATE_JSON).read_text())
    tensors = load_file(str(state_dir / STATE_TENSORS))
    net.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in record["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def check_resume(out: Path, resume: bool, args: dict[str, Any], must_match: tuple[str, ...]) -> dict[str, Any] | None:
    """The saved record of the run in `out` when resuming (its settings must equal `args` on
    `must_match`); None for a new run, which `out` must not hold already."""
    state_dir = out / STATE_DIR
    if resume:
        if not (state_dir / STATE_JSON).is_file():
            raise TrainError(f"--resume: no training state at {state_dir / STATE_JSON}")
        saved = json.loads((state_dir / STATE_JSON).read_text())
        diffs = [f"--{k.replace('_', '-')} {args[k]!r} (the run has {saved['args'].get(k)!r})"
                 for k in must_match if saved["args"].get(k) != args[k]]
        if diffs:
            raise TrainError("--resume must keep the run's settings: " + "; ".join(diffs))
        return saved
    if (state_dir / STATE_JSON).is_file():
        step = json.loads((state_dir / STATE_JSON).read_text()).get("step")
        raise TrainError(f"{out} holds a training run already (at step {step}): --resume continues it, "
                         "or choose another --out")
    return None


def target_features(
    model: FastLlama, tokenizer: Any, state_dir: Path, *, data: str, max_tokens: int, seed: int, chunk_len: int,
    resume: bool, log: Callable[[str], None], source: str | None = None, file: str = FEATURES_FILE,
) -> FeatureSet:
    """The run's features: `source` (a features file of another run) if given, else the run's own
    (`file` in the state folder) when resuming, else the target run over the corpus now (and saved,
    for a resume)."""
    path = Path(source) if source else state_dir / file
    if source or (resume and path.is_file()):
        if not path.is_file():
            raise TrainError(f"--features: no file {path}")
        fs = FeatureSet.load(path)
        log(f"features: {fs.num_tokens} tokens from {path}")
    else:
        if resume:
            log(f"{path} is gone: running the target over the corpus again")
        corpus = build_corpus(parse_sources(data), tokenizer, max_tokens, seed)
        if corpus.num_tokens < 2:
            raise TrainError(f"--data {data}: the corpus is empty")
        fs = extract_features(model, chunk_documents(corpus.documents, chunk_len))
        fs.meta["sources"] = corpus.stats
        fs.save(path)
        log(f"features: {fs.num_tokens} tokens in {fs.meta['extract_s']} s ({fs.meta['tokens_per_s']} tokens/s)")
    if fs.features.shape[1] != model.info.hidden_size:
        raise TrainError(f"{path}: features of size {fs.features.shape[1]}, the target's hidden size is "
                         f"{model.info.hidden_size}; delete the file to extract them again")
    return fs


def check_common_args(args: Any, positive: tuple[str, ...]) -> None:
    """What every trainer's settings share: the sizes in `positive`, --draft-vocab, --lr,
    --grad-clip, --stop-at and --save-dtype. Each trainer checks its own on top."""
    for name in positive:
        if getattr(args, name) <= 0:
            raise TrainError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.draft_vocab < 0:
        raise TrainError(f"--draft-vocab must be >= 0 (0: the full vocabulary), got {args.draft_vocab}")
    if args.lr <= 0 or args.grad_clip <= 0:
        raise TrainError("--lr and --grad-clip must be positive")
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        raise TrainError(f"--stop-at must be in 1..--steps ({args.steps}), got {args.stop_at}")
    if args.save_dtype not in SAVE_DTYPES:
        raise TrainError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}")
    if args.eval_data is not None:
        if args.eval_windows == 0:
            raise TrainError("--eval-data needs --eval-windows > 0: the windows it holds out")
        parse_sources(args.eval_data)  # a bad source fails before the target loads


@dataclass
class HeldOut:
    """The windows the run reports on and never trains on, and the features they index."""

    fs: FeatureSet
    windows: list[tuple[int, int]]
    source: str  # for the card: where the windows come from


def held_out_split(model: FastLlama, tokenizer: Any, state_dir: Path, fs: FeatureSet, args: Any,
                   log: Callable[[str], None]) -> tuple[HeldOut, list[tuple[int, int]]]:
    """(held out, training windows). By default a seeded random share of the corpus's windows;
    those come from the same prompts and files as the training windows and so flatter a drafter.
    With --eval-data, the first --eval-windows windows of a separate corpus (answers to prompts never
    trained on, say), and every corpus window trains."""
    windows = fs.windows(args.seq_len)
    if args.eval_data is None:
        held, train = split_windows(windows, args.eval_windows, args.seed)
        return HeldOut(fs, held, SHARE_OF_CORPUS), train
    eval_fs = target_features(model, tokenizer, state_dir, data=args.eval_data,
                              max_tokens=args.eval_windows * args.seq_len, seed=args.seed, chunk_len=args.chunk_len,
                              resume=args.resume, log=lambda line: log(f"held out {line}"), file=EVAL_FEATURES_FILE)
    if shared := sorted(set(eval_fs.meta.get("sources", {})) & set(fs.meta.get("sources", {}))):
        raise TrainError(f"--eval-data: {', '.join(shared)} is in the training corpus too; held-out text "
                         "must not be trained on")
    held = eval_fs.windows(args.seq_len)[: args.eval_windows]
    return HeldOut(eval_fs, held, f"--eval-data {args.eval_data}"), windows


def draft_vocab_of(fs: FeatureSet, model: FastLlama, size: int) -> tuple[torch.Tensor | None, float]:
    """The draft vocabulary (`size` most frequent corpus tokens, end-of-sequence first; None: the
    whole vocabulary, for size 0 or at least the vocabulary) and its corpus coverage."""
    if not 0 < size < model.info.vocab_size:
        return None, 1.0
    vocab = select_draft_vocab(fs.ids, model.info.vocab_size, size, sorted(model.info.eos_token_ids))
    return vocab, vocab_coverage(fs.ids, vocab)


def new_record(fmt: str, args: Any, fs: FeatureSet, held: HeldOut, train: list, vocab: torch.Tensor | None,
               coverage: float, vocab_size: int, eval_initial: dict[str, float] | None) -> dict[str, Any]:
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


def held_out_note(record: dict[str, Any]) -> str:
    """The card's sentence on the held-out windows: how many, and where from."""
    w = record["windows"]
    origin = w.get("held_out_from", SHARE_OF_CORPUS)
    if (sources := w.get("held_out_sources")) is not None:  # --eval-data: a corpus of its own
        origin = f"`{origin}`, a separate corpus of {sum(s['tokens'] for s in sources.values())} tokens"
    return f"{w['held_out']} held out (never trained on; {origin}) for the numbers below."


def resumed_record(saved: dict[str, Any], args: dict[str, Any], command: str) -> dict[str, Any]:
    """A resumed run's record: the saved one with this session's settings and command added."""
    record = {k: v for k, v in saved.items() if k != "param_groups"}
    record["args"] = {**args, "resume": False}
    record["sessions"] = [*record.get("sessions", []), command]
    return record


@dataclass(frozen=True)
class Checkpoint:
    step: int
    train: dict[str, float] | None  # the step statistics' means since the last checkpoint (None: no step)
    train_s: float  # seconds of steps since the last checkpoint (evaluation and writing excluded)


def run_steps(
    opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], *, start: int, stop: int, save_every: int,
    grad_clip: float, desc: str, lr_at: Callable[[int], float],
    loss_at: Callable[[int], tuple[torch.Tensor, dict[str, float]]], on_checkpoint: Callable[[Checkpoint], None],
    final: bool,
) -> None:
    """Steps start .. stop - 1 (lr, loss, backward, clipped AdamW update), `on_checkpoint` every
    `save_every` steps and at `stop`, there also when no step ran if `final` (nothing written yet).
    A step's statistics: floats, averaged over the steps between checkpoints, except the count "n"."""
    sums: dict[str, float] = {}
    num = 0
    started = time.perf_counter()

    def checkpoint(step: int) -> None:
        nonlocal sums, num, started
        means = {k: round(v / num, 6) for k, v in sums.items()} if num else None
        on_checkpoint(Checkpoint(step, means, time.perf_counter() - started))
        sums, num = {}, 0
        started = time.perf_counter()

    with tqdm(total=stop, initial=start, unit="step", desc=desc, disable=None) as bar:
        for step in range(start, stop):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss, stats = loss_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            for k, v in stats.items():
                if k != "n":
                    sums[k] = sums.get(k, 0.0) + v
            num += 1
            bar.update(1)
            top1 = next((k for k in stats if k.startswith("top1")), None)
            bar.set_postfix(loss=f"{stats['loss']:.4f}", **({top1: f"{stats[top1]:.3f}"} if top1 else {}))
            if (step + 1) % save_every == 0 and step + 1 < stop:
                checkpoint(step + 1)
    if start < stop or final:
        checkpoint(stop)


def record_checkpoint(record: dict[str, Any], entry: dict[str, Any], train_s: float, state_dir: Path,
                      net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Add a checkpoint's history entry (its "step" first) to the record and save the state."""
    record["train_s"] = round(record["train_s"] + train_s, 3)
    record["history"].append(entry)
    record["step"] = entry["step"]
    record["updated"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    save_state(state_dir, net, opt, record)
