"""Draft trees: several candidates per position, verified by the target in one forward.

A chain drafts one token per position, so a step stops at the first position where the
drafter's top choice is wrong. A tree keeps the best few candidates per position (EAGLE-2's
dynamic tree, Medusa's candidate tree): the target scores every node in one forward, each node
attending to the context and its own ancestors only, and the step keeps the longest root path
the target agrees with. Verification stays lossless (workers/verify.py).

Nodes are numbered in creation order, so a parent always comes before its children; the root
is the step's last emitted token (index -1), the input the target runs before the draft.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    parents: tuple[int, ...]  # per node, its parent node (-1: the root); parents[i] < i
    depths: tuple[int, ...] = field(init=False)  # per node, 1 + its parent's depth (the root's is 0)

    def __post_init__(self) -> None:
        depths: list[int] = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: a parent must be an earlier node or -1")
            depths.append(1 if p < 0 else depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, n: int) -> DraftTree:
        return cls(tuple(range(-1, n - 1)))

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def leading_chain(self) -> int:
        """How many first nodes form a chain from the root (node i's parent is node i - 1): the
        inputs a chain of their tokens would have, in the same places (see verify.py on
        row-invariant targets)."""
        n = 0
        while n < len(self.parents) and self.parents[n] == n - 1:
            n += 1
        return n

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: a tree too (parents come first), for when only n inputs fit."""
        return DraftTree(self.parents[:n])

    def children(self, node: int) -> list[int]:
        """`node`'s children in order (node -1: the root's)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def input_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """[n + 1, n + 1] bool over the step's inputs (root, then nodes): row i sees column j
        when j is i or one of its ancestors."""
        n = len(self.parents)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i + 1] |= mask[p + 1]
        return mask.to(device)

    def input_offsets(self, device: torch.device | None = None) -> torch.Tensor:
        """[n + 1] position of each input after the root's: the root 0, a node its depth."""
        return torch.tensor((0, *self.depths), dtype=torch.long, device=device)

    def root_paths(self) -> list[RootPath]:
        """The inputs (root, then nodes) as root paths, one per leaf in node order, each input
        computed by the first path through it: a row-invariant target scores the tree as these
        chains (workers/models/llama.py), every node as plain decoding would after its ancestors."""
        has_child = {p for p in self.parents if p >= 0}
        done: set[int] = set()
        paths = []
        for leaf in (i for i in range(len(self.parents)) if i not in has_child):
            inputs, node = [], leaf
            while node >= 0:
                inputs.append(node + 1)
                node = self.parents[node]
            inputs = [0, *reversed(inputs)]
            first = next(j for j, i in enumerate(inputs) if i not in done)  # the inputs done form a prefix
            done.update(inputs)
            paths.append(RootPath(tuple(inputs), first))
        return paths or [RootPath((0,), 0)]


@dataclass(frozen=True)
class RootPath:
    """A path of a tree step's inputs from the root (input 0; node i is input i + 1), and the
    index of the first of them this path computes (those before it, an earlier path did)."""

    inputs: tuple[int, ...]
    first: int


@dataclass
class TreeGrowth:
    """A tree being grown: candidate nodes with their parent, draft-vocabulary row, depth and
    score (the log-probability of the path from the root under the drafter)."""

    parent: list[int] = field(default_factory=list)
    row: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    cache_row: dict[int, int] = field(default_factory=dict)  # expanded node -> its row in the drafter's cache

    def level_inputs(
        self, nodes: list[int], context_len: int, cache_len: int, device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [m] and attention mask [m, cache_len + m] for running `nodes` as one level in a
        drafter whose cache holds context_len context rows, then earlier levels' rows: a node sits
        at the position of its depth and sees the context, its ancestors and itself, as a chain
        through it would. The nodes' rows are recorded for the next level."""
        mask = torch.zeros(len(nodes), cache_len + len(nodes), dtype=torch.bool)
        mask[:, :context_len] = True
        for r, node in enumerate(nodes):
            ancestor = self.parent[node]
            while ancestor >= 0:
                mask[r, self.cache_row[ancestor]] = True
                ancestor = self.parent[ancestor]
            mask[r, cache_len + r] = True
            self.cache_row[node] = cache_len + r
        positions = torch.tensor([context_len + self.depth[n] - 1 for n in nodes])
        return positions.to(device), mask.to(device)

    def add_children(self, parent: int, logprobs: torch.Tensor, topk: int) -> list[int]:
        """The `topk` most likely children of `parent` under logprobs [draft vocab]; impossible
        tokens (log-probability -inf, e.g. cut by top-p) are not candidates."""
        base = 0.0 if parent < 0 else self.score[parent]
        depth = 1 if parent < 0 else self.depth[parent] + 1
        values, rows = torch.topk(logprobs, min(topk, logprobs.shape[-1]))
        added = []
        for v, r in zip(values.tolist(), rows.tolist()):
            if v == float("-inf"):
                break
            added.append(len(self.parent))
            self.parent.append(parent)
            self.row.append(r)
            self.depth.append(depth)
            self.score.append(base + v)
        return added


def grow_tree(
    root_logprobs: torch.Tensor,
    expand: Callable[[TreeGrowth, list[int]], torch.Tensor],
    depth: int,
    topk: int,
    num_nodes: int,
) -> tuple[list[int], DraftTree]:
    """EAGLE-2's dynamic draft tree: per depth, expand the `topk` most likely nodes of the newest
    level, each into its `topk` most likely children; then keep the `num_nodes` most likely
    nodes overall. A child's score never exceeds its parent's, so the kept set contains every
    kept node's ancestors (ties go to the earlier node, the parent).

    `expand(growth, nodes)` returns [len(nodes), draft vocab] log-probabilities of each node's
    next token. Returns the kept nodes' draft-vocabulary rows and their tree, in creation order.
    topk = 1 with num_nodes = depth is the greedy chain."""
    growth = TreeGrowth()
    level = growth.add_children(-1, root_logprobs, topk)
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda i: -growth.score[i])[:topk]
        if not frontier:
            break
        logprobs = expand(growth, frontier)
        level = [c for node, lp in zip(frontier, logprobs) for c in growth.add_children(node, lp, topk)]
    ranked = sorted(range(len(growth.parent)), key=lambda i: (-growth.score[i], i))
    kept = sorted(ranked[:num_nodes])
    index = {node: i for i, node in enumerate(kept)}
    parents = tuple(-1 if growth.parent[n] < 0 else index[growth.parent[n]] for n in kept)
    return [growth.row[n] for n in kept], DraftTree(parents)
