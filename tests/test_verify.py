"""verify_greedy / verify_sampled on hand-built tensors.

The statistical tests follow vLLM's rejection-sampler tests: hand-chosen target and drafter
distributions over a small vocabulary, many seeded trials, a chi-square goodness-of-fit test
against the exact target distribution. Every seed is fixed, so the outcome is deterministic; the
negative controls show the same harness rejects a sampler that is not lossless.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from workers.sampling import PositionDraws, greedy_ids
from workers.tree import DraftTree
from workers.verify import VerifyResult, verify_drawn, verify_greedy, verify_sampled

V = 6  # vocabulary of the statistical tests
NUM_TRIALS = 20_000
NUM_CHAIN_TRIALS = 12_000
MIN_P_VALUE = 1e-4  # a correct sampler fails this one time in 10_000 per test; seeds are fixed
MAX_TV = 0.02  # total variation between the empirical and the exact distribution (see tv_bound)


# ---------------------------------------------------------------------------------------------
# greedy


def one_hot_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(argmaxes), vocab] logits whose row i has its maximum at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def test_greedy_ids_pick_the_index_torch_argmax_picks() -> None:
    """The target's token per row, whatever computes it: the first of tied maxima, a NaN over
    every number, a row of -inf its first index; in full-vocabulary rows, views of a batch's
    logits, one row alone, and bfloat16 (torch's own argmax)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49152, generator=g)
    logits[1, [70, 900]] = 100.0  # tied maxima
    logits[2, [5, 40]] = float("nan")
    logits[3] = float("-inf")
    logits[4, [8, 30000]] = float("inf")
    logits[5] = logits[5].round()  # many ties below the maximum
    for rows in (logits, logits[2:7], logits[6], logits[::2], logits.to(torch.bfloat16)):
        assert torch.equal(greedy_ids(rows), rows.argmax(dim=-1))
    assert greedy_ids(logits)[1:5].tolist() == [70, 5, 0, 8]


def test_greedy_all_accepted_appends_bonus() -> None:
    logits = one_hot_logits([3, 1, 4, 7])  # k = 3: rows 0..2 check the draft, row 3 is the bonus
    result = verify_greedy(logits, torch.tensor([3, 1, 4]))
    assert result == VerifyResult(num_accepted=3, token_ids=[3, 1, 4, 7])


def test_greedy_first_rejected_emits_target_argmax() -> None:
    logits = one_hot_logits([5, 1, 4, 7])
    result = verify_greedy(logits, torch.tensor([3, 1, 4]))
    assert result == VerifyResult(num_accepted=0, token_ids=[5])


def test_greedy_middle_rejected_keeps_prefix_then_recovers() -> None:
    logits = one_hot_logits([3, 1, 9, 7, 2])
    result = verify_greedy(logits, torch.tensor([3, 1, 4, 7]))
    # position 3 agrees with the target again, but nothing after a rejection counts
    assert result == VerifyResult(num_accepted=2, token_ids=[3, 1, 9])


def test_greedy_empty_draft_is_one_plain_token() -> None:
    logits = one_hot_logits([6])
    result = verify_greedy(logits, torch.empty(0, dtype=torch.long))
    assert result == VerifyResult(num_accepted=0, token_ids=[6])


def test_greedy_eos_inside_draft_is_an_ordinary_token() -> None:
    eos = 2  # verification knows nothing about EOS: trimming is the engine's job
    logits = one_hot_logits([4, eos, 8, 1])
    result = verify_greedy(logits, torch.tensor([4, eos, 8]))
    assert result == VerifyResult(num_accepted=3, token_ids=[4, eos, 8, 1])


def test_greedy_returns_python_ints() -> None:
    result = verify_greedy(one_hot_logits([3, 1]), torch.tensor([3]))
    assert all(type(t) is int for t in result.token_ids)
    assert type(result.num_accepted) is int


# ---------------------------------------------------------------------------------------------
# sampled: deterministic cases


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_sampled_target_one_hot_on_draft_always_accepts() -> None:
    k = 3
    draft = torch.tensor([1, 4, 2])
    target = torch.zeros(k + 1, V)
    target[torch.arange(k), draft] = 1.0
    target[k] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # the bonus can only be 5
    q = torch.full((k, V), 1.0 / V)
    g = gen()
    for draft_probs in (q, None):
        for _ in range(200):
            result = verify_sampled(target, draft, draft_probs, g)
            assert result == VerifyResult(num_accepted=3, token_ids=[1, 4, 2, 5])


def test_sampled_zero_target_probability_always_rejects() -> None:
    draft = torch.tensor([3, 0])
    target = torch.tensor([
        [0.3, 0.3, 0.2, 0.0, 0.1, 0.1],  # p(3) = 0: the first draft token can never be accepted
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    q = torch.tensor([
        [0.05, 0.05, 0.05, 0.7, 0.1, 0.05],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ])
    g = gen(1)
    for draft_probs in (q, None):
        seen = set()
        for _ in range(500):
            result = verify_sampled(target, draft, draft_probs, g)
            assert result.num_accepted == 0
            assert len(result.token_ids) == 1
            assert result.token_ids[0] != 3
            seen.add(result.token_ids[0])
        assert seen <= {0, 1, 2, 4, 5}
        assert len(seen) >= 4  # the recovered token really is sampled, not a fixed fallback


def test_sampled_empty_draft_samples_the_target() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    result = verify_sampled(target, torch.empty(0, dtype=torch.long), None, gen())
    assert result == VerifyResult(num_accepted=0, token_ids=[2])


def test_sampled_is_reproducible_with_the_same_generator_seed() -> None:
    target = torch.softmax(torch.randn(4, V, generator=gen(5)), dim=-1)
    q = torch.softmax(torch.randn(3, V, generator=gen(6)), dim=-1)
    draft = torch.tensor([0, 1, 2])
    a = [verify_sampled(target, draft, q, g) for g in [gen(7)] for _ in range(50)]
    b = [verify_sampled(target, draft, q, g) for g in [gen(7)] for _ in range(50)]
    assert a == b
    assert len({tuple(r.token_ids) for r in a}) > 1


# ---------------------------------------------------------------------------------------------
# sampled: distribution tests


def assert_distributed_as(samples: np.ndarray, expected: np.ndarray, what: str) -> None:
    """samples: int array of tokens in [0, V); expected: [V] probabilities."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(expected)).astype(float)
    zero = expected == 0
    assert counts[zero].sum() == 0, f"{what}: tokens with target probability 0 were emitted: {counts}"
    _, p_value = chisquare(counts[~zero], expected[~zero] * n)
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert p_value > MIN_P_VALUE, f"{what}: chi-square p={p_value:.2e}, counts {counts}, expected {expected * n}"
    assert tv < tv_bound(expected, n), f"{what}: total variation {tv:.4f}"


def tv_bound(expected: np.ndarray, n: int) -> float:
    """MAX_TV, or twice the total variation a correct sampler shows on average at n samples where
    that is more: 0.5 * sum_i E|count_i / n - p_i|, each count ~normal (1,200 samples of a
    6-token row average ~0.022, over MAX_TV; a sampler drawing from the wrong row shows ~0.3)."""
    return max(MAX_TV, 2 * 0.5 * float(np.sqrt(2 * expected * (1 - expected) / (np.pi * n)).sum()))


# Target distributions per position (k = 3: rows 0..2 judge the draft, row 3 is the bonus).
# Zeros on purpose: a residual that puts mass where the target has none must be caught.
TARGET = np.array([
    [0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
    [0.05, 0.50, 0.05, 0.20, 0.00, 0.20],
    [0.30, 0.00, 0.30, 0.10, 0.25, 0.05],
    [0.10, 0.15, 0.20, 0.25, 0.00, 0.30],
])
DRAFTERS = {
    # near: most of the target's mass, a little elsewhere
    "near": 0.8 * TARGET[:3] + 0.2 * np.array([[1 / 6] * 6] * 3),
    # far: mass where the target has little or none
    "far": np.array([
        [0.02, 0.03, 0.05, 0.10, 0.20, 0.60],
        [0.40, 0.02, 0.30, 0.03, 0.20, 0.05],
        [0.05, 0.60, 0.05, 0.20, 0.05, 0.05],
    ]),
}


def run_single_calls(draft_probs: np.ndarray | None, seed: int) -> list[VerifyResult]:
    """NUM_TRIALS independent verify_sampled calls against TARGET. A sampling drafter draws each
    position from its row; the deterministic drafter always proposes each row's target argmax
    (tokens 0, 1, 0: probable enough that all-accepted trials are common)."""
    k = TARGET.shape[0] - 1
    rng = np.random.default_rng(seed)
    if draft_probs is None:
        drafts = np.tile(TARGET[:k].argmax(axis=1), (NUM_TRIALS, 1))
    else:
        cum = draft_probs.cumsum(axis=1)
        drafts = np.stack([np.searchsorted(cum[i], rng.random(NUM_TRIALS), side="right") for i in range(k)], 1)
        drafts = np.minimum(drafts, V - 1)
    target = torch.tensor(TARGET, dtype=torch.float32)
    q = None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32)
    g = gen(seed)
    return [verify_sampled(target, torch.from_numpy(d), q, g) for d in drafts]


@pytest.fixture(scope="module", params=["near", "far", "deterministic"])
def single_calls(request: pytest.FixtureRequest) -> tuple[str, list[VerifyResult]]:
    name = request.param
    seed = {"near": 101, "far": 202, "deterministic": 303}[name]
    return name, run_single_calls(DRAFTERS.get(name), seed=seed)


def test_sampled_first_token_follows_target_whatever_the_drafter(single_calls) -> None:
    name, results = single_calls
    first = np.array([r.token_ids[0] for r in results])
    assert_distributed_as(first, TARGET[0], f"{name}: position 0")


def test_sampled_each_reached_position_follows_its_target_row(single_calls) -> None:
    """Given that the output reaches position i (all earlier drafts accepted), the token there
    is distributed as TARGET[i]; for i = k this is the bonus token."""
    name, results = single_calls
    k = TARGET.shape[0] - 1
    checked = 0
    for i in range(k + 1):
        tokens = np.array([r.token_ids[i] for r in results if len(r.token_ids) > i])
        if len(tokens) < 1000:  # too few to test at this strictness (the far drafter's tail)
            continue
        assert_distributed_as(tokens, TARGET[i], f"{name}: position {i} ({len(tokens)} samples)")
        checked += 1
    assert checked >= (2 if name == "far" else k + 1)


def test_sampled_bonus_follows_last_target_row_when_all_accepted(single_calls) -> None:
    name, results = single_calls
    k = TARGET.shape[0] - 1
    bonus = np.array([r.token_ids[k] for r in results if r.num_accepted == k])
    if name == "far":
        assert len(bonus) < 0.03 * NUM_TRIALS  # the far drafter is rarely fully accepted (p = 0.018)
        return
    assert len(bonus) > 1000
    assert_distributed_as(bonus, TARGET[k], f"{name}: bonus")


def test_sampled_acceptance_rate_matches_theory(single_calls) -> None:
    """Position 0 is accepted with probability sum_x min(p(x), q(x)) (q one-hot for the
    deterministic drafter)."""
    name, results = single_calls
    q0 = DRAFTERS[name][0] if name in DRAFTERS else np.eye(V)[TARGET[0].argmax()]
    expected = np.minimum(TARGET[0], q0).sum()
    observed = np.mean([r.num_accepted > 0 for r in results])
    sd = np.sqrt(expected * (1 - expected) / NUM_TRIALS)
    assert abs(observed - expected) < 5 * sd, (observed, expected)


def test_harness_rejects_a_sampler_that_is_not_lossless() -> None:
    """Negative control: accepting every far draft makes position 0 follow q, not p; the same
    test must fail loudly."""
    rng = np.random.default_rng(3)
    cum = DRAFTERS["far"][0].cumsum()
    wrong = np.minimum(np.searchsorted(cum, rng.random(NUM_TRIALS), side="right"), V - 1)
    with pytest.raises(AssertionError):
        assert_distributed_as(wrong, TARGET[0], "accept-everything sampler")
    # and a subtler bug: recovering from p instead of norm(max(p - q, 0))
    p, q = TARGET[0], DRAFTERS["near"][0]
    accept = np.minimum(p, q)
    wrong_dist = accept + (1 - accept.sum()) * p
    cum = wrong_dist.cumsum()
    wrong = np.minimum(np.searchsorted(cum / cum[-1], rng.random(NUM_TRIALS * 5), side="right"), V - 1)
    with pytest.raises(AssertionError):
        assert_distributed_as(wrong, TARGET[0], "residual = p sampler")


# Sequence test: a Markov-chain target and drafter over several speculative steps.
# Emitting N tokens takes one or more steps of k = 2; the emitted sequence must have exactly the
# target chain's joint distribution, wherever the step boundaries fall.
SEQ_V = 5
SEQ_N = 3
SEQ_K = 2
T_CHAIN = np.array([
    [0.50, 0.20, 0.15, 0.10, 0.05],
    [0.10, 0.40, 0.30, 0.00, 0.20],
    [0.25, 0.25, 0.25, 0.15, 0.10],
    [0.05, 0.05, 0.10, 0.60, 0.20],
    [0.30, 0.10, 0.00, 0.20, 0.40],
])
D_CHAINS = {
    "near": 0.7 * T_CHAIN + 0.3 * np.full((SEQ_V, SEQ_V), 1 / SEQ_V),
    "far": np.array([
        [0.05, 0.05, 0.10, 0.20, 0.60],
        [0.40, 0.05, 0.05, 0.40, 0.10],
        [0.05, 0.05, 0.05, 0.05, 0.80],
        [0.50, 0.30, 0.10, 0.05, 0.05],
        [0.10, 0.20, 0.60, 0.05, 0.05],
    ]),
}


def run_chain(draft_chain: np.ndarray | None, seed: int, num_trials: int,
              verify=verify_sampled) -> np.ndarray:
    """[num_trials] sequence codes y0 * V^2 + y1 * V + y2 of speculative decoding from token 0."""
    rng = np.random.default_rng(seed)
    g = gen(seed)
    t_chain = torch.tensor(T_CHAIN, dtype=torch.float32)
    cum = None if draft_chain is None else draft_chain.cumsum(axis=1)
    d_chain = None if draft_chain is None else torch.tensor(draft_chain, dtype=torch.float32)
    # the deterministic drafter proposes its chain's most likely next token: T's argmax
    greedy_next = T_CHAIN.argmax(axis=1)
    codes = np.empty(num_trials, dtype=np.int64)
    for trial in range(num_trials):
        out: list[int] = []
        last = 0
        while len(out) < SEQ_N:
            draft, prev = [], last
            for _ in range(SEQ_K):
                if cum is None:
                    x = int(greedy_next[prev])
                else:
                    x = min(int(np.searchsorted(cum[prev], rng.random(), side="right")), SEQ_V - 1)
                draft.append(x)
                prev = x
            contexts = [last, *draft]  # row i of the target judges the token after contexts[i]
            target_probs = t_chain[contexts]
            draft_probs = None if d_chain is None else d_chain[contexts[:-1]]
            result = verify(target_probs, torch.tensor(draft), draft_probs, g)
            out += result.token_ids
            last = out[-1]
        y = out[:SEQ_N]
        codes[trial] = (y[0] * SEQ_V + y[1]) * SEQ_V + y[2]
    return codes


def chain_joint() -> np.ndarray:
    joint = np.einsum("a,ab,bc->abc", T_CHAIN[0], T_CHAIN, T_CHAIN)
    return joint.reshape(-1)


def assert_sequences_follow_chain(codes: np.ndarray, what: str) -> None:
    expected = chain_joint()
    n = len(codes)
    counts = np.bincount(codes, minlength=len(expected)).astype(float)
    zero = expected == 0
    assert counts[zero].sum() == 0, f"{what}: impossible sequences emitted"
    # pool the sparse cells so every chi-square cell expects at least 5 samples
    small = (~zero) & (expected * n < 5)
    obs = np.append(counts[~zero & ~small], counts[small].sum())
    exp = np.append(expected[~zero & ~small], expected[small].sum()) * n
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    _, p_value = chisquare(obs, exp)
    assert p_value > MIN_P_VALUE, f"{what}: chi-square p={p_value:.2e}"
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv < 0.05, f"{what}: total variation {tv:.4f}"


@pytest.mark.parametrize("drafter", ["near", "far", "deterministic"])
def test_sampled_sequences_across_steps_follow_the_target_chain(drafter: str) -> None:
    seed = {"near": 11, "far": 12, "deterministic": 13}[drafter]
    codes = run_chain(D_CHAINS.get(drafter), seed=seed, num_trials=NUM_CHAIN_TRIALS)
    assert_sequences_follow_chain(codes, drafter)


def test_sequence_harness_rejects_a_biased_verifier() -> None:
    """Negative control for the sequence test: a verifier that accepts with min(1, p/q) but
    recovers from p itself instead of the residual (the classic bug) must fail it."""

    def biased(target_probs, draft_ids, draft_probs, generator):
        result = verify_sampled(target_probs, draft_ids, draft_probs, generator)
        n = result.num_accepted
        if n == len(draft_ids):
            return result
        last = int(torch.multinomial(target_probs[n], 1, generator=generator))
        return VerifyResult(n, draft_ids[:n].tolist() + [last])

    codes = run_chain(D_CHAINS["far"], seed=5, num_trials=5_000, verify=biased)
    with pytest.raises(AssertionError):
        assert_sequences_follow_chain(codes, "biased")


# ---------------------------------------------------------------------------------------------
# sampled, draws keyed by position: exact match against the target's own draw


def test_drawn_verification_emits_the_draws_plain_sampling_makes() -> None:
    """Whatever the draft, each emitted token is the target's draw at its position: an accepted
    draft token equals it, the first mismatch is replaced by it, and all-accepted adds the bonus."""
    target = torch.tensor(TARGET, dtype=torch.float32)
    for seed in range(200):
        draws = PositionDraws(seed)
        plain = [draws.draw(target[i], i) for i in range(4)]
        for draft in ([0, 1, 0], plain[:3], [plain[0], 5, plain[2]], [3, 3, 3], []):
            result = verify_drawn(target[: len(draft) + 1], torch.tensor(draft, dtype=torch.long), draws, 0)
            n = result.num_accepted
            assert draft[:n] == plain[:n] and (n == len(draft) or draft[n] != plain[n])
            assert result.token_ids == plain[: n + 1]


def test_drawn_verification_of_a_tree_follows_the_child_drawn() -> None:
    """Root 0 with children a (0) and b (1); a's child c (2). Rows: after root, a, b, c."""
    tree = DraftTree((-1, -1, 0))
    target = torch.tensor(TARGET, dtype=torch.float32)
    rows = target[[0, 1, 2, 3]]
    hits = 0
    for seed in range(300):
        draws = PositionDraws(seed)
        first, draft = draws.draw(rows[0], 10), torch.tensor([0, 1, 3])
        result = verify_drawn(rows, draft, draws, 10, tree)
        assert result.token_ids[0] == first
        if first == 0:  # node a: then a's row (row 1) is drawn at depth 1, c kept where it draws 3
            second = draws.draw(rows[1], 11)
            assert result.path[:1] == (0,) and result.token_ids[1] == second
            hits += second == 3
        elif first == 1:  # node b, a leaf: the bonus comes from b's row
            assert result.path == (1,) and result.token_ids == [1, draws.draw(rows[2], 11)]
        else:
            assert result.path == () and result.num_accepted == 0
    assert hits > 0  # the path through c was taken


def test_drawn_verification_accepts_a_deterministic_token_with_its_target_probability() -> None:
    """The first draft token (TARGET[0]'s likeliest, p 0.40) is accepted at that rate over seeds,
    as rejection sampling accepts a one-hot q."""
    target = torch.tensor(TARGET, dtype=torch.float32)
    n = 4000
    accepted = sum(verify_drawn(target[:2], torch.tensor([0]), PositionDraws(s), 5).num_accepted for s in range(n))
    assert abs(accepted / n - 0.40) < 4 * np.sqrt(0.4 * 0.6 / n)
