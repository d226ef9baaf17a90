"""Verification of a draft against the target: pure functions over tensors.

Terms (after vLLM's rejection sampler):
  * accepted tokens: the longest prefix of the draft the target agrees with;
  * recovered token: at the first rejected position, a token drawn from the residual
    distribution norm(max(p - q, 0)), which makes the output exactly target-distributed;
  * bonus token: when every draft token is accepted, one more token from the target's
    distribution after the last draft token (it comes free with the same forward).
Every step therefore emits num_accepted + 1 tokens. k = 0 is plain decoding.

Rejection sampling follows Leviathan et al. 2023 / Chen et al. 2023: accept draft token x with
probability min(1, p(x) / q(x)). A deterministic drafter (probs=None) proposes with q one-hot on
x, so acceptance is p(x) and the residual is p with x removed.

A draft tree (workers/tree.py) is verified from the root down: at each node the target's token
is chosen among the node's children, and the step follows the child chosen. Greedy: the child
equal to the target's argmax. Sampled (SpecInfer's multi-candidate rejection sampling, with
deterministic candidates): child c is accepted with probability r(c) / sum(r), where r starts as
the target's p at the node and each rejected child is removed from it; when every child is
rejected the token is drawn from what is left of r. That is exactly a draw from p, so the output
stays target-distributed.

A seeded request whose draws are keyed by position (workers/sampling.py PositionDraws) verifies
by exact match instead, greedy's rule with the argmax replaced by the position's own draw: a
chain's or a tree's node is accepted where its token is the one the target draws there
(`verify_drawn`). A deterministic draft token is accepted with probability p(x) as under
rejection sampling, a tree's children with their summed mass as under SpecInfer's rule, and the
output is plain sampling's with the same draws.

On a row-invariant target (compact weights, workers/models/llama.py) every row is scored bit for
bit as plain decoding scores it, a tree's nodes too: each root path of the tree gets an
attention call of its own, its keys where a chain's would be.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.sampling import PositionDraws, greedy_ids, sample_ids
from workers.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    token_ids: list[int]  # the accepted draft tokens, then one recovered or bonus token
    path: tuple[int, ...] = ()  # a tree's accepted nodes, root first (a chain: unused)


def verify_greedy(target_logits: torch.Tensor, draft_ids: torch.Tensor) -> VerifyResult:
    """target_logits: [k + 1, vocab], row i predicts the token after draft position i - 1.
    draft_ids: [k]. Accepts while the draft equals the target's argmax."""
    k = draft_ids.shape[0]
    target_ids = greedy_ids(target_logits)  # [k + 1]
    num_accepted = int((target_ids[:k] == draft_ids).cumprod(dim=0).sum()) if k else 0
    return VerifyResult(num_accepted, target_ids[: num_accepted + 1].tolist())


def verify_sampled(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> VerifyResult:
    """target_probs: [k + 1, vocab]; draft_ids: [k]; draft_probs: [k, vocab] or None for a
    deterministic drafter. Both distributions must already carry the request's temperature,
    top-k and top-p (workers.sampling.probs_from_logits)."""
    k = draft_ids.shape[0]
    positions = torch.arange(k, device=target_probs.device)
    p = target_probs[positions, draft_ids]  # [k] target probability of each draft token
    q = draft_probs[positions, draft_ids] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(k, generator=generator, device=target_probs.device)
    rejected = (u * q >= p).nonzero()  # u < p / q accepts; q > 0 since x was drawn from q
    num_accepted = int(rejected[0, 0]) if rejected.numel() else k

    if num_accepted == k:
        dist = target_probs[k]  # bonus
    elif draft_probs is not None:
        dist = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp_min(0)
    else:
        dist = target_probs[num_accepted].clone()
        dist[draft_ids[num_accepted]] = 0
    # sample_ids normalises; a rejection implies p < q somewhere, so dist has mass
    last = sample_ids(dist, generator)
    return VerifyResult(num_accepted, draft_ids[:num_accepted].tolist() + [int(last)])


def verify_tree_greedy(
    target_logits: torch.Tensor, draft_ids: torch.Tensor, tree: DraftTree,
) -> VerifyResult:
    """target_logits: [n + 1, vocab], row 0 after the root, row i + 1 after node i; draft_ids: [n]."""
    target_ids = greedy_ids(target_logits).tolist()
    return _follow(draft_ids.tolist(), tree, lambda node, depth: target_ids[node + 1])


def _follow(draft: list[int], tree: DraftTree, target_token: Callable[[int, int], int]) -> VerifyResult:
    """The exact-match walk from the root: at each node, the child whose token is the target's
    there (`target_token(node, depth)`: the token the row after `node` gives, node -1 the root),
    until none is; then that token ends the step."""
    path: list[int] = []
    node = -1
    while True:
        token = target_token(node, len(path))
        nxt = next((c for c in tree.children(node) if draft[c] == token), None)
        if nxt is None:
            return VerifyResult(len(path), [draft[i] for i in path] + [token], tuple(path))
        path.append(nxt)
        node = nxt


def verify_tree_sampled(
    target_probs: torch.Tensor, draft_ids: torch.Tensor, tree: DraftTree, generator: torch.Generator,
) -> VerifyResult:
    """target_probs: [n + 1, vocab] with the request's sampling settings applied, rows as in
    verify_tree_greedy; the tree's candidates are deterministic (no drafter probabilities)."""
    draft = draft_ids.tolist()
    path: list[int] = []
    node = -1
    while True:
        residual = target_probs[node + 1].clone()
        children = tree.children(node)
        u = torch.rand(len(children), generator=generator, device=target_probs.device).tolist()
        chosen = None
        for child, u_c in zip(children, u):
            total = float(residual.sum())
            mass = float(residual[draft[child]])
            if u_c * total < mass:
                chosen = child
                break
            residual[draft[child]] = 0
        if chosen is None:
            drawn = int(sample_ids(residual, generator))
            return VerifyResult(len(path), [draft[i] for i in path] + [drawn], tuple(path))
        path.append(chosen)
        node = chosen


def verify_drawn(
    target_probs: torch.Tensor, draft_ids: torch.Tensor, draws: PositionDraws, start: int,
    tree: DraftTree | None = None,
) -> VerifyResult:
    """target_probs: [n + 1, vocab] with the request's sampling settings applied, rows as in
    verify_tree_greedy (a chain: row i after draft position i - 1); the root's row predicts
    position `start`, a row at depth d position start + d, drawn there by `draws`. Only the rows
    on the accepted path are drawn."""
    draft = draft_ids.tolist()
    result = _follow(draft, tree or DraftTree.chain(len(draft)),
                     lambda node, depth: draws.draw(target_probs[node + 1], start + depth))
    return result if tree is not None else VerifyResult(result.num_accepted, result.token_ids)
