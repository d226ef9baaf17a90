"""The training steps: a data order that is a function of the step (so a resumed run repeats the
uninterrupted one exactly), the step loop with its checkpoints, and held-out averages."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from training.data import Window


class Batcher:
    """Sample i of the run is window perm_epoch[i mod n], epoch = i // n: a function of the step."""

    def __init__(self, windows: list[Window], batch: int, seed: int) -> None:
        self.windows, self.batch, self.seed = windows, batch, seed
        self._epoch, self._perm = -1, []

    def at(self, step: int) -> list[Window]:
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


def batches(windows: list[Window], batch: int) -> Iterable[list[Window]]:
    """The held-out windows in order, `batch` at a time."""
    return (windows[i : i + batch] for i in range(0, len(windows), batch))


def weighted_means(stats: Iterable[dict[str, float]], count: str) -> dict[str, float]:
    """Each statistic averaged over batches weighted by their "n", and the total n as `count`."""
    sums: dict[str, float] = {}
    total = 0.0
    for s in stats:
        for k, v in s.items():
            if k != "n":
                sums[k] = sums.get(k, 0.0) + v * s["n"]
        total += s["n"]
    return {k: round(v / total, 6) for k, v in sums.items()} | {count: int(total)}


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
