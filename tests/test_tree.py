"""Draft trees: shape and masks, EAGLE-2's tree growth, tree verification (greedy on hand-built
logits, sampled against the exact target distribution), the target's tree forward against chain
forwards along each path, and the model drafter's trees lossless on the tiny target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import TwoTokenCase, chains_where_steps_verify_chains
from scipy.stats import chisquare

from workers.config import EngineConfig, ModelConfig, ModelDrafterConfig, TreeConfig
from workers.engine import SpecEngine
from workers.sampling import SamplingParams
from workers.target import ModelLoadError
from workers.tree import DraftTree, RootPath, TreeGrowth, grow_tree
from workers.verify import verify_tree_greedy, verify_tree_sampled

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
TREE = DraftTree((-1, -1, 0, 0, 1, 2))


def test_tree_shape_mask_and_offsets() -> None:
    assert TREE.depths == (1, 1, 2, 2, 2, 3) and TREE.depth == 3
    assert TREE.children(-1) == [0, 1] and TREE.children(0) == [2, 3] and TREE.children(5) == []
    assert TREE.input_offsets().tolist() == [0, 1, 1, 2, 2, 2, 3]
    mask = TREE.input_mask()
    seen = {i - 1: [j - 1 for j in range(7) if mask[i, j]] for i in range(7)}  # -1: the root
    assert seen == {-1: [-1], 0: [-1, 0], 1: [-1, 1], 2: [-1, 0, 2], 3: [-1, 0, 3], 4: [-1, 1, 4], 5: [-1, 0, 2, 5]}
    chain = DraftTree.chain(4)
    assert torch.equal(chain.input_mask(), torch.ones(5, 5, dtype=torch.bool).tril())
    assert TREE.prefix(3) == DraftTree((-1, -1, 0))
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        DraftTree((-1, 1))


def table_expand(table: torch.Tensor):  # noqa: ANN201 - a test's callback
    """expand() over a fixed table: a node's children log-probabilities depend on its row only."""
    return lambda growth, nodes: table[[growth.row[n] for n in nodes]]


def test_grow_tree_topk_one_is_the_greedy_chain() -> None:
    table = torch.randn(10, 10, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    root = table[3]
    rows, tree = grow_tree(root, table_expand(table), depth=4, topk=1, num_nodes=4)
    chain = [int(root.argmax())]
    for _ in range(3):
        chain.append(int(table[chain[-1]].argmax()))
    assert rows == chain and tree == DraftTree.chain(4)


def test_grow_tree_keeps_the_most_likely_nodes_with_their_ancestors() -> None:
    table = torch.randn(12, 12, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    seen: list[TreeGrowth] = []

    def expand(growth: TreeGrowth, nodes: list[int]) -> torch.Tensor:
        seen.append(growth)
        return table[[growth.row[n] for n in nodes]]

    rows, tree = grow_tree(table[0], expand, depth=4, topk=3, num_nodes=7)
    assert len(tree) == 7 and tree.depth <= 4
    # the kept nodes' path scores are the 7 best of every candidate grown
    scores: list[float] = []
    for row, parent in zip(rows, tree.parents):
        prev_row = 0 if parent < 0 else rows[parent]
        scores.append((0.0 if parent < 0 else scores[parent]) + float(table[prev_row, row]))
    best = sorted(seen[0].score, reverse=True)[:7]
    assert sorted(scores, reverse=True) == pytest.approx(best)
    # impossible tokens are never candidates
    masked = torch.full((12,), float("-inf"))
    masked[[2, 5]] = 0.0
    rows, tree = grow_tree(masked.log_softmax(-1), table_expand(table), depth=1, topk=4, num_nodes=8)
    assert sorted(rows) == [2, 5] and len(tree) == 2


def one_hot_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def test_tree_greedy_follows_the_targets_child_down() -> None:
    draft = torch.tensor([4, 7, 1, 2, 3, 9])  # node tokens of TREE
    # rows: after root, after node 0..5; the target picks 7 (node 1), then 3 (node 4), then 8
    result = verify_tree_greedy(one_hot_logits([7, 0, 3, 0, 0, 8, 0]), draft, TREE)
    assert (result.num_accepted, result.token_ids, result.path) == (2, [7, 3, 8], (1, 4))
    result = verify_tree_greedy(one_hot_logits([4, 1, 0, 9, 0, 0, 5]), draft, TREE)  # 4 -> 1 -> 9 -> bonus 5
    assert (result.num_accepted, result.token_ids, result.path) == (3, [4, 1, 9, 5], (0, 2, 5))
    result = verify_tree_greedy(one_hot_logits([6, 0, 0, 0, 0, 0, 0]), draft, TREE)  # no child matches
    assert (result.num_accepted, result.token_ids, result.path) == (0, [6], ())


def test_a_trees_root_paths_compute_each_input_once_in_a_chain_of_its_ancestors() -> None:
    """How a row-invariant target scores a tree (workers/models/llama.py _TreeAttention)."""
    assert (TREE.leading_chain, DraftTree.chain(4).leading_chain, DraftTree((-1, 0, 0, 1)).leading_chain) == (1, 4, 2)
    assert DraftTree.chain(3).root_paths() == [RootPath((0, 1, 2, 3), 0)]
    assert DraftTree(()).root_paths() == [RootPath((0,), 0)]
    # node 2's path was computed up to node 0 by the leading chain's; node 3, a root child, alone
    assert DraftTree((-1, 0, 0, -1)).root_paths() == [RootPath((0, 1, 2), 0), RootPath((0, 1, 3), 2),
                                                      RootPath((0, 4), 1)]
    for tree in (TREE, DraftTree((-1, -1, 0, 1, 2, 2, -1, 6, 7, 3))):
        paths = tree.root_paths()
        computed = sorted(i for p in paths for i in p.inputs[p.first :])
        assert computed == list(range(len(tree) + 1))  # every input once
        for p in paths:  # a path is the root, then each node's child
            assert p.inputs[0] == 0 and all(tree.parents[b - 1] == a - 1 for a, b in zip(p.inputs, p.inputs[1:]))


def test_tree_sampled_is_exactly_target_distributed() -> None:
    """Root children 0 and 1 (node 0 has a child 2); the emitted (first, second) pair must follow
    p_root, then p at the node taken."""
    V, trials = 5, 12_000
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.15, 0.25],  # after the root
                          [0.4, 0.1, 0.1, 0.2, 0.2],  # after node 0 (token 1)
                          [0.05, 0.05, 0.3, 0.3, 0.3],  # after node 1 (token 4)
                          [0.2, 0.2, 0.2, 0.2, 0.2]])  # after node 2
    tree, draft = DraftTree((-1, -1, 0)), torch.tensor([1, 4, 0])
    after = {1: probs[1], 4: probs[2]}
    cells: dict[tuple[int, ...], float] = {}
    for a in range(V):
        if a in after:
            for b in range(V):
                cells[(a, b)] = float(probs[0, a] * after[a][b])
        else:
            cells[(a,)] = float(probs[0, a])
    counts = dict.fromkeys(cells, 0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        result = verify_tree_sampled(probs, draft, tree, gen)
        counts[tuple(result.token_ids[:2])] += 1
        assert [draft[i] for i in result.path] == result.token_ids[: result.num_accepted]
    keys = sorted(cells)
    expected = np.array([cells[c] for c in keys])
    _, p_value = chisquare(np.array([counts[c] for c in keys]), expected / expected.sum() * trials)
    assert p_value > 1e-4


def test_target_tree_forward_equals_chains_along_each_path(tiny_engine: SpecEngine) -> None:
    model = tiny_engine.target.model
    prompt = tiny_engine.encode("The quick brown fox", chat=False)
    nodes = torch.tensor([11, 23, 35, 47, 59, 61])
    cache = model.new_cache(64)
    model.forward(torch.tensor(prompt[:-1]), cache)
    start = cache.length
    out = model.forward(torch.tensor([prompt[-1], *nodes.tolist()]), cache, tree=TREE, return_hidden=True)
    for node in range(len(TREE)):
        path = [node]
        while TREE.parents[path[-1]] >= 0:
            path.append(TREE.parents[path[-1]])
        chain_cache = model.new_cache(64)
        model.forward(torch.tensor(prompt[:-1]), chain_cache)
        chain = model.forward(torch.tensor([prompt[-1], *nodes[path[::-1]].tolist()]), chain_cache)
        torch.testing.assert_close(out.logits[node + 1], chain.logits[-1], atol=1e-4, rtol=1e-4)
    # keeping the path root -> 0 -> 2 leaves the cache a chain would have left
    cache.keep(start, [0, 1, 3])
    chain_cache = model.new_cache(64)
    model.forward(torch.tensor([*prompt, 11, 35]), chain_cache)
    assert cache.length == chain_cache.length
    torch.testing.assert_close(cache.k[:, :, : cache.length], chain_cache.k[:, :, : cache.length], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tree_engine(tiny_engine: SpecEngine, tiny_llama_dir, tiny_drafter_dir) -> SpecEngine:  # noqa: ANN001
    drafters = [ModelDrafterConfig(name="other_tree", model=ModelConfig(model=str(tiny_drafter_dir)),
                                   tree=TreeConfig(topk=3, nodes=8)),
                # the target itself: its two most likely tokens are the candidates
                ModelDrafterConfig(name="self_tree", model=ModelConfig(model=str(tiny_llama_dir)),
                                   tree=TreeConfig(topk=2, nodes=4))]
    return SpecEngine.from_config(EngineConfig(target=tiny_engine.config.target, drafters=drafters))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_model_drafter_tree_greedy_identical_to_plain(tree_engine: SpecEngine, k: int) -> None:
    for text in ["The quick brown fox jumps over the lazy dog.", "x = 1\ny = 2\n"]:
        ids = tree_engine.encode(text)
        plain = tree_engine.generate(ids, SamplingParams(max_tokens=24))
        out = tree_engine.generate(ids, SamplingParams(max_tokens=24), "other_tree", k)
        assert out.token_ids == plain.token_ids
        drafted = [s for s in out.steps if s.num_tree_nodes]
        assert drafted and max(s.num_draft_tokens for s in drafted) <= k  # k is the depth
        assert max(s.num_tree_nodes for s in drafted) > k  # several candidates per position


def test_model_drafter_drafts_chains_where_the_step_verifies_a_chain(tree_engine: SpecEngine) -> None:
    chains_where_steps_verify_chains(tree_engine, "other_tree", 3, "The quick brown fox jumps over the lazy dog.")


def test_model_drafter_tree_sampled_follows_target_distribution(tree_engine: SpecEngine) -> None:
    """Two of the target's three possible tokens are candidates: accepted and rejected alike."""
    results = TwoTokenCase.of(tree_engine).check(tree_engine, "self_tree", 2, 600)
    assert 0 < sum(r.num_accepted_tokens for r in results) < 600


def test_tree_on_a_backend_without_tree_support_is_refused(tiny_engine: SpecEngine, tiny_drafter_dir) -> None:  # noqa: ANN001
    drafter = ModelDrafterConfig(name="t", model=ModelConfig(model=str(tiny_drafter_dir), backend="hf"),
                                 tree=TreeConfig())
    with pytest.raises(ModelLoadError, match="draft trees need the fast Llama backend"):
        SpecEngine.from_config(EngineConfig(target=tiny_engine.config.target, drafters=[drafter]))
