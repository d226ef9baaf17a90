"""The target's features over a corpus, by teacher forcing (one forward per chunk, no generation).

Each document is cut into chunks of `chunk_len` tokens; the target (FastLlama, batch 1) runs every
chunk from an empty cache with `return_hidden=True` and its final-norm hidden states (the input
of its lm_head, what EAGLE regresses) are kept as float16 next to the token ids. The target's
next-token distribution is not stored: the trainer recomputes it as `feature @ lm_head` over the
draft vocabulary, which costs less than reading 49k-wide logits back.

A `FeatureSet` saves to one safetensors file, so a resumed training run trains on exactly the
same numbers without running the target again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from workers.models.base import synchronize
from workers.models.llama import FastLlama


@dataclass
class FeatureSet:
    ids: torch.Tensor  # [N] int64: every chunk's tokens, concatenated
    features: torch.Tensor  # [N, hidden] float16: the target's final-norm hidden state at each token
    bounds: torch.Tensor  # [C + 1] int64: chunk c is ids[bounds[c] : bounds[c + 1]]
    meta: dict[str, Any] = field(default_factory=dict)  # corpus statistics, extraction speed

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def windows(self, seq_len: int) -> list[tuple[int, int]]:
        """Training windows as (first pair, number of pairs). Pair i is (features[i], ids[i + 1]) with
        target features[i + 1]; a window never crosses a chunk, and holds at most seq_len pairs."""
        out = []
        for a, b in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist()):
            pairs = b - a - 1
            out += [(a + s, min(seq_len, pairs - s)) for s in range(0, pairs, seq_len)]
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tensors = {"ids": self.ids.to(torch.int32), "features": self.features, "bounds": self.bounds}
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> FeatureSet:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        t = load_file(str(path))
        return cls(t["ids"].long(), t["features"], t["bounds"].long(), meta)


def chunk_documents(documents: Sequence[Sequence[int]], chunk_len: int) -> list[list[int]]:
    """Documents cut into chunks of at most chunk_len tokens; a chunk needs two tokens (one pair)."""
    return [list(doc[s : s + chunk_len]) for doc in documents for s in range(0, len(doc), chunk_len)
            if len(doc) - s >= 2]


def extract_features(model: FastLlama, chunks: Sequence[Sequence[int]], *, progress: bool | None = None) -> FeatureSet:
    """Run the target over every chunk (fresh cache each) and keep its final-norm hidden states."""
    if not chunks:
        raise ValueError("no chunks to extract features from")
    longest = max(len(c) for c in chunks)
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.long)
    bounds = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0)))
    total = int(bounds[-1])
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
    features = torch.empty(total, model.info.hidden_size, dtype=torch.float16)
    cache = model.new_cache(longest)
    start = time.perf_counter()
    disable = None if progress is None else not progress  # None: a bar on a terminal, silence in logs and tests
    with tqdm(total=total, unit="tok", desc="target features", disable=disable) as bar:
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            cache.truncate(0)
            out = model.forward(ids[a:b].to(model.device), cache, last_only=True, return_hidden=True)
            features[a:b] = out.hidden.to("cpu", torch.float16)
            bar.update(b - a)
    synchronize(model.device)
    wall = time.perf_counter() - start
    meta = {"tokens": total, "chunks": len(chunks), "extract_s": round(wall, 3),
            "tokens_per_s": round(total / wall, 1) if wall > 0 else None,
            "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch.")}
    return FeatureSet(ids, features, bounds, meta)


def select_draft_vocab(ids: torch.Tensor, vocab_size: int, size: int, first: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids of the corpus (ties and unseen tokens by id), after the
    ids in `first` (the target's end-of-sequence tokens: every answer ends with one)."""
    counts = torch.bincount(ids, minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    head = [t for t in dict.fromkeys(first) if 0 <= t < vocab_size]
    rest = order[~torch.isin(order, torch.tensor(head, dtype=torch.long))] if head else order
    return torch.cat((torch.tensor(head, dtype=torch.long), rest))[:size]


def vocab_coverage(ids: torch.Tensor, vocab: torch.Tensor) -> float:
    """Share of the corpus tokens that the draft vocabulary can propose."""
    return float(torch.isin(ids, vocab).float().mean()) if ids.numel() else 0.0
