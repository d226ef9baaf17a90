"""SamplingParams validation, probs_from_logits (temperature, min-p, top-k, top-p) and sample_ids."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from workers.drafters.base import RACE_POWER, DraftContext, draft_tokens
from workers.sampling import PositionDraws, SamplingParams, make_generator, probs_from_logits, sample_at, sample_ids


def params(**kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 1.0), **kw)


def log_probs(*probs: float) -> torch.Tensor:
    """[1, n] logits whose softmax is probs (given in any order)."""
    return torch.tensor([[math.log(p) for p in probs]])


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, -2.0]])
    for t in (0.25, 0.7, 1.0, 2.0, 10.0):
        got = probs_from_logits(logits, params(temperature=t))
        torch.testing.assert_close(got, torch.softmax(logits / t, dim=-1))
    cold = probs_from_logits(logits, params(temperature=0.05))
    hot = probs_from_logits(logits, params(temperature=50.0))
    assert cold[0, 0] > 0.999  # low temperature concentrates on the argmax
    assert (hot - 0.25).abs().max() < 0.02  # high temperature flattens


def test_output_is_float32_and_rows_sum_to_one() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for p in (params(), params(top_k=7), params(top_p=0.5), params(top_k=20, top_p=0.9, temperature=0.6)):
        probs = probs_from_logits(logits, p)
        assert probs.dtype == torch.float32
        assert probs.shape == (5, 100)
        torch.testing.assert_close(probs.sum(-1), torch.ones(5))
        assert (probs >= 0).all()


@pytest.mark.parametrize("k", [1, 2, 5, 99])
def test_top_k_keeps_exactly_the_k_largest(k: int) -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(k))  # distinct values
    probs = probs_from_logits(logits, params(top_k=k))
    assert ((probs > 0).sum(-1) == k).all()
    top = torch.topk(logits, k, dim=-1).indices
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top, True)
    assert (probs[~kept] == 0).all()
    # the kept tokens keep their relative odds: softmax renormalised over the top k
    expected = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("k", [0, 100, 1000])
def test_top_k_zero_or_at_least_vocab_keeps_everything(k: int) -> None:
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(probs_from_logits(logits, params(top_k=k)), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    ("top_p", "num_kept"),
    [
        (0.3, 1),  # the argmax alone already holds 0.5
        (0.51, 2),
        (0.79, 2),  # 0.5 + 0.3 = 0.8 >= 0.79
        (0.81, 3),
        (0.96, 4),
        (1.0, 5),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p: float, num_kept: int) -> None:
    # probabilities 0.5, 0.3, 0.15, 0.04, 0.01, shuffled so position is not rank
    order = [3, 0, 4, 1, 2]
    base = [0.5, 0.3, 0.15, 0.04, 0.01]
    logits = log_probs(*[base[i] for i in order])
    probs = probs_from_logits(logits, params(top_p=top_p))[0]
    kept = {order.index(rank) for rank in range(num_kept)}  # positions of the top num_kept
    assert {i for i in range(5) if probs[i] > 0} == kept
    mass = sum(base[:num_kept])
    for rank in range(num_kept):
        assert probs[order.index(rank)].item() == pytest.approx(base[rank] / mass, rel=1e-5)


@pytest.mark.parametrize("top_p", [1e-6, 5e-324])  # the second is 0 in float32
def test_top_p_always_keeps_the_argmax_even_for_tiny_top_p(top_p: float) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    probs = probs_from_logits(logits, params(top_p=top_p))
    argmax = logits.argmax(-1)
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(argmax, 50).float())


def test_top_p_is_applied_per_row() -> None:
    # row 0 is peaked (argmax 0.9 alone reaches 0.8), row 1 is flat (needs 4 of 5 tokens)
    logits = torch.cat([log_probs(0.9, 0.04, 0.03, 0.02, 0.01), log_probs(0.2, 0.2, 0.2, 0.2, 0.2) + 1.0])
    logits[1] += torch.tensor([0.0, 1e-3, 2e-3, 3e-3, 4e-3])  # break the ties
    probs = probs_from_logits(logits, params(top_p=0.8))
    assert (probs[0] > 0).sum() == 1
    assert (probs[1] > 0).sum() == 4
    assert probs[1, 0] == 0  # the smallest one goes


def _nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p rule over a full sort of the vocabulary's probabilities: which tokens are kept."""
    sorted_probs, order = torch.sort(logits.softmax(dim=-1), dim=-1, descending=True)
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    return ~drop.scatter(-1, order, drop)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_tokens_a_full_sort_keeps(temperature: float, top_p: float) -> None:
    """Over SmolLM2's 49,152-token vocabulary, peaked rows (a nucleus of a few tokens) and flat
    ones (thousands: the cut then looks past its first ranks): the same tokens as the rule over
    the whole sorted vocabulary."""
    g = torch.Generator().manual_seed(int(100 * top_p + temperature))
    peaked = torch.randn(3, 49152, generator=g) * 4
    flat = torch.randn(3, 49152, generator=g) * 0.5
    for logits in (peaked, flat, torch.cat([peaked, flat])):
        probs = probs_from_logits(logits, params(temperature=temperature, top_p=top_p))
        assert torch.equal(probs > 0, _nucleus_by_full_sort(logits / temperature, top_p))
    if top_p >= 0.5 and temperature >= 1.0:  # flat rows: the cut looked past its first ranks
        assert ((probs_from_logits(flat, params(temperature=temperature, top_p=top_p)) > 0).sum(-1) > 256).all()


def test_top_k_then_top_p_support_is_within_top_k() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    probs = probs_from_logits(logits, params(top_k=5, top_p=0.9))
    top5 = torch.topk(logits, 5, dim=-1).indices
    in_top5 = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top5, True)
    assert (probs[~in_top5] == 0).all()
    assert ((probs > 0).sum(-1) >= 1).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_min_p_drops_tokens_below_min_p_times_the_likeliest(temperature: float) -> None:
    """vLLM's rule on the distribution after temperature; min-p comes before top-k and top-p."""
    logits = log_probs(0.5, 0.3, 0.12, 0.08)
    scaled = torch.softmax(logits / temperature, dim=-1)
    got = probs_from_logits(logits, params(temperature=temperature, min_p=0.45))
    kept = scaled >= 0.45 * scaled.max()
    assert 1 < int(kept.sum()) < 4
    torch.testing.assert_close(got, torch.where(kept, scaled, 0) / scaled[kept].sum())
    everything = probs_from_logits(logits, params(temperature=temperature, min_p=0.0))
    torch.testing.assert_close(everything, scaled)
    assert probs_from_logits(logits, params(min_p=1.0))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # top-p then cuts what min-p left, renormalised: 0.5 / (0.5 + 0.3) >= 0.6 (without min-p 0.5 < 0.6)
    assert (probs_from_logits(logits, params(top_p=0.6)) > 0).sum() == 2
    assert (probs_from_logits(logits, params(min_p=0.3, top_p=0.6)) > 0).sum() == 1


# SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 129}, "min_tokens"),
    ],
)
def test_sampling_params_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    value = next(iter(kwargs.values()))
    assert str(value) in str(info.value)


def test_sampling_params_refuses_empty_token_lists() -> None:
    with pytest.raises(ValueError, match="^allowed_token_ids "):
        SamplingParams(allowed_token_ids=frozenset())
    with pytest.raises(ValueError, match="^bad_words "):
        SamplingParams(bad_words=((),))


def test_sampling_params_accepts_boundary_values() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    assert p.greedy
    assert not SamplingParams(temperature=1e-3).greedy
    SamplingParams(top_p=1e-9)


def test_make_generator_seeded_streams_repeat_and_unseeded_differ() -> None:
    a, b = make_generator(42), make_generator(42)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    assert not torch.equal(torch.rand(8, generator=make_generator(42)), torch.rand(8, generator=make_generator(43)))
    assert not torch.equal(torch.rand(8, generator=make_generator(None)), torch.rand(8, generator=make_generator(None)))


def test_sample_ids_draws_each_row_from_its_own_distribution_and_never_a_zero() -> None:
    """200,000 draws a row of unnormalised masses with zeros (a rejection's residual): each row's
    frequencies within chi-square and a total variation of 0.005 of its distribution."""
    mass = torch.tensor([[2.0, 0.0, 7.0, 1.0, 0.0, 10.0],
                         [0.0, 0.5, 0.0, 0.0, 3.0, 0.5]])
    n = 200_000
    ids = sample_ids(mass.repeat_interleave(n, dim=0).view(2, n, 6).transpose(0, 1), make_generator(0))
    assert ids.shape == (n, 2) and ids.dtype == torch.long
    for row in range(2):
        expected = (mass[row] / mass[row].sum()).numpy()
        counts = np.bincount(ids[:, row].numpy(), minlength=6)
        assert counts[expected == 0].sum() == 0
        assert chisquare(counts[expected > 0], expected[expected > 0] * n).pvalue > 1e-4
        assert 0.5 * np.abs(counts / n - expected).sum() < 0.005


def test_sample_ids_keeps_leading_dims_repeats_with_its_seed_and_refuses_rows_without_mass() -> None:
    probs = torch.softmax(torch.randn(3, 49_152, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert sample_ids(probs[0], make_generator(1)).shape == ()
    assert torch.equal(sample_ids(probs, make_generator(1)), sample_ids(probs, make_generator(1)))
    assert sample_ids(torch.tensor([0.0, 0.0, 1.0]), make_generator(2)) == 2
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan"), 0.5])):
        with pytest.raises(ValueError, match="mass"):
            sample_ids(bad, make_generator(3))


def test_position_draws_are_fixed_per_seed_and_position() -> None:
    """A seed's draw at a position is the same however often it is asked; other seeds and
    positions draw otherwise; any int seed works."""
    probs = torch.softmax(torch.randn(49_152, generator=torch.Generator().manual_seed(0)), dim=-1)
    draws = PositionDraws(7)
    tokens = [draws.draw(probs, t) for t in range(32)]
    assert tokens == [draws.draw(probs, t) for t in range(32)]
    assert len(set(tokens)) > 16  # a flat row: the positions draw independently
    assert [PositionDraws(8).draw(probs, t) for t in range(32)] != tokens
    assert PositionDraws(-3).draw(probs, 0) == PositionDraws(-3).draw(probs, 0)
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan"), 0.5])):
        with pytest.raises(ValueError, match="mass"):
            draws.draw(bad, 0)


@pytest.mark.parametrize("row", [
    [0.5, 0.3, 0.0, 0.2],  # every token in the head
    [0.6, 0.3995, 0.0002, 0.0002, 0.0001, 0.0, 0.0],  # three tokens in the tail
    [3.0, 1.0, 0.0, 0.004, 0.001],  # unnormalised
    [1e-4] * 5000 + [0.5],  # half the mass in a tail of 5,000 tokens, half on one token
], ids=["head", "tail", "unnormalised", "heavy-tail"])
def test_position_draws_sample_the_row(row: list[float]) -> None:
    """Over many seeds (and positions) the draws follow the row's probabilities: chi-square over
    its tokens (the heavy tail pooled), zero-probability tokens never drawn. A grid of small seeds
    by small positions counts too, where a weak hash would correlate them."""
    probs = torch.tensor(row, dtype=torch.float32)
    p = np.asarray(row) / sum(row)
    tokens = np.array([PositionDraws(seed).draw(probs, t) for seed in range(100) for t in range(40)])
    assert not np.isin(tokens, np.flatnonzero(p == 0)).any()
    counts = np.bincount(tokens, minlength=len(p)).astype(float)
    if len(p) > 100:  # the tail pooled, its first token apart: a rare one must not be skipped
        counts, p = np.array([counts[0], counts[1:-1].sum(), counts[-1]]), np.array([p[0], p[1:-1].sum(), p[-1]])
    kept = p > 0
    assert chisquare(counts[kept], p[kept] * len(tokens)).pvalue > 1e-4


def test_a_drafter_racing_on_the_same_draws_draws_the_targets_token() -> None:
    """A drafter's draw on the same keyed exponentials is coupled to the target's: with q = p it
    is the target's token at every seed; with q near p at least as often as the coupling's bound,
    overlap / (2 - overlap), and far more often than the target draws q's likeliest token."""
    p = torch.tensor([0.45, 0.35, 0.15, 0.05])
    q = torch.tensor([0.35, 0.45, 0.12, 0.08])
    near = likeliest = 0
    n = 2000
    for seed in range(n):
        draws = PositionDraws(seed)
        target = draws.draw(p, 3)
        assert draws.draw(p.clone(), 3) == target
        near += draws.draw(q, 3) == target
        likeliest += target == 1  # q's likeliest token
    overlap = float(torch.minimum(p, q).sum())  # 0.87: what rejection sampling accepts
    assert near / n > overlap / (2 - overlap) - 0.03 and near / n > likeliest / n + 0.3


def test_a_race_among_a_few_tokens_is_the_draw_of_their_row() -> None:
    """`race` of a few tokens at their weights picks what `draw` picks from a vocabulary row that
    holds those weights alone, at every seed and position."""
    tokens, weights = [40, 3, 17], [5.0, 3.0, 1.0]  # counts, unnormalised
    row = torch.zeros(64)
    row[tokens] = torch.tensor(weights)
    picks = []
    for seed in range(50):
        draws = PositionDraws(seed)
        for t in range(20):
            picks.append(draws.race(tokens, weights, t))
            assert picks[-1] == draws.draw(row, t)
    assert set(picks) == set(tokens)


def test_a_model_drafters_tokens_race_its_sharpened_distribution_on_the_keyed_draws() -> None:
    """`draft_tokens`: greedy takes the argmax; with keyed draws each row is the draw of q ** 2
    (over the whole vocabulary, the draft vocabulary's ids mapped) at its own position, with no
    q returned; without, a draw of q, returned for rejection sampling."""
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))
    vocab_ids = torch.tensor([10, 2, 7, 3, 0])  # draft row -> the target's token id
    params = SamplingParams(temperature=0.8, seed=9)
    draws = PositionDraws(9)
    greedy = DraftContext([1, 2], SamplingParams(), make_generator(0), 16)
    tokens, q = draft_tokens(logits, greedy, 2, vocab_ids, 12)
    assert tokens.tolist() == vocab_ids[logits.argmax(-1)].tolist() and q is None
    raced = DraftContext([1, 2], params, make_generator(9), 16, draws=draws)
    tokens, q = draft_tokens(logits, raced, 2, vocab_ids, 12)
    full = torch.zeros(3, 12)
    full[:, vocab_ids] = probs_from_logits(logits, params) ** RACE_POWER
    assert tokens.tolist() == [draws.draw(full[i], 2 + i) for i in range(3)] and q is None
    assert set(tokens.tolist()) <= set(vocab_ids.tolist())
    drawn = DraftContext([1, 2], params, make_generator(9), 16)
    tokens, q = draft_tokens(logits, drawn, 2, vocab_ids, 12)
    assert q is not None and q.shape == (3, 12) and bool((q[torch.arange(3), tokens] > 0).all())


def test_sample_at_inverts_the_cumulative_mass() -> None:
    mass = torch.tensor([[1.0, 0.0, 3.0], [0.0, 2.0, 2.0]])
    assert sample_at(mass, torch.tensor([0.2, 0.2])).tolist() == [0, 1]
    assert sample_at(mass, torch.tensor([0.3, 0.6])).tolist() == [2, 2]
    assert sample_at(mass[0], torch.tensor(0.9999)).item() == 2


def test_top_p_gives_a_row_the_same_probabilities_whatever_rows_share_its_call() -> None:
    """A row whose nucleus ends inside a run of equal probabilities, alone and beside a flat row
    (which makes the call sort more ranks): the same tokens kept, ties taken in id order."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(49_152, generator=g) - 20
    row[:40] = torch.linspace(4.0, 3.2, 40)  # 71% of the mass
    ties = torch.randperm(49_152, generator=g)[:30]
    ties = ties[ties >= 40]
    row[ties] = 3.0  # equal logits straddling where top-p 0.9 cuts
    flat = torch.randn(49_152, generator=g) * 0.01
    params = SamplingParams(temperature=1.0, top_p=0.9)
    alone = probs_from_logits(row[None], params)[0]
    for rows in (torch.stack([row, flat]), torch.stack([flat, row, flat])):
        beside = probs_from_logits(rows, params)
        assert torch.equal(beside[(rows == row).all(dim=-1)][0], alone)
    kept_ties = sorted(ties[alone[ties] > 0].tolist())
    assert 0 < len(kept_ties) < len(ties) and kept_ties == sorted(ties.tolist())[: len(kept_ties)]
