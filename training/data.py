"""What a run trains and reports on: the target's features over the corpus, the held-out windows,
and the draft vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.args import TrainArgs, TrainError
from training.corpus import build_corpus, parse_sources
from training.features import FeatureSet, chunk_documents, extract_features, select_draft_vocab, vocab_coverage
from training.state import EVAL_FEATURES_FILE, FEATURES_FILE
from workers.models.llama import FastLlama

SHARE_OF_CORPUS = "a random share of the corpus's windows"  # where held-out windows come from by default

Window = tuple[int, int]  # (first pair, number of pairs): see FeatureSet.windows


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


def split_windows(windows: list[Window], eval_windows: int, seed: int) -> tuple[list[Window], list[Window]]:
    """(held out, train): at most eval_windows and a tenth of all are held out, chosen by the seed."""
    n_eval = min(eval_windows, len(windows) // 10) if eval_windows > 0 else 0
    if eval_windows > 0 and n_eval == 0 and len(windows) >= 2:
        n_eval = 1
    perm = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(perm[:n_eval])
    return ([w for i, w in enumerate(windows) if i in held], [w for i, w in enumerate(windows) if i not in held])


@dataclass
class HeldOut:
    """The windows the run reports on and never trains on, and the features they index."""

    fs: FeatureSet
    windows: list[Window]
    source: str  # for the card: where the windows come from


def held_out_split(model: FastLlama, tokenizer: Any, state_dir: Path, fs: FeatureSet, args: TrainArgs,
                   log: Callable[[str], None]) -> tuple[HeldOut, list[Window]]:
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


def draft_head_t(model: FastLlama, vocab: torch.Tensor | None) -> torch.Tensor:
    """The target's lm_head over the draft vocabulary, [h, V] (the whole head for None), its dtype
    and device."""
    head_t = model.view().head_t
    return head_t if vocab is None else head_t[:, vocab.to(model.device)]
