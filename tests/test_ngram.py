"""NgramDrafter (prompt lookup): matching rules, incremental index, configuration."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from workers.config import NgramDrafterConfig
from workers.drafters.base import DraftContext
from workers.drafters.ngram import NgramDrafter
from workers.sampling import SamplingParams, make_generator


def make(min_n: int = 2, max_n: int = 4) -> NgramDrafter:
    return NgramDrafter(NgramDrafterConfig(min_n=min_n, max_n=max_n))


def ctx(ids: list[int]) -> DraftContext:
    return DraftContext(ids, SamplingParams(), make_generator(0), max_len=len(ids) + 128)


def propose(ids: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    drafter = make(min_n, max_n)
    c = ctx(list(ids))
    draft = drafter.propose(drafter.begin(c), c, k)
    assert draft.probs is None  # deterministic drafter
    assert draft.token_ids.dtype == torch.long
    return draft.token_ids.tolist()


def reference(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: for n = max_n .. min_n, the latest earlier occurrence of the last n tokens
    that has at least one token after it; propose up to k tokens that follow it."""
    for n in range(max_n, min_n - 1, -1):
        if len(ids) < n:
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # occurrence ids[start:start+n], not the suffix
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []


def test_proposes_continuation_of_the_match() -> None:
    ids = [1, 2, 3, 4, 5, 6, 9, 2, 3]
    assert propose(ids, k=3) == [4, 5, 6]


def test_prefers_the_latest_earlier_occurrence() -> None:
    ids = [7, 8, 10, 11, 7, 8, 20, 21, 7, 8]
    assert propose(ids, k=2) == [20, 21]


def test_prefers_the_longest_matching_suffix() -> None:
    # the 2-gram (5, 6) last occurred before 30, but the 3-gram (4, 5, 6) only before 10
    ids = [4, 5, 6, 10, 11, 0, 5, 6, 30, 31, 4, 5, 6]
    assert propose(ids, k=2, min_n=2, max_n=3) == [10, 11]
    assert propose(ids, k=2, min_n=2, max_n=2) == [30, 31]


def test_falls_back_to_shorter_ngrams() -> None:
    ids = [1, 2, 3, 50, 60, 9, 8, 3]  # only the 1-gram (3,) recurs
    assert propose(ids, k=2, min_n=2, max_n=4) == []
    assert propose(ids, k=2, min_n=1, max_n=4) == [50, 60]


def test_no_match_proposes_nothing() -> None:
    assert propose(list(range(20)), k=5) == []
    assert propose([], k=5) == []
    assert propose([3], k=5, min_n=1, max_n=1) == []


def test_never_matches_the_suffix_with_itself() -> None:
    # the only occurrence of (8, 9) is the suffix itself
    assert propose([1, 2, 3, 8, 9], k=4) == []
    # a repeated token: (5, 5) occurs earlier, overlapping the suffix, at positions 0..1 and 1..2
    assert propose([5, 5, 5], k=4) == [5]


def test_caps_at_k_and_at_the_end_of_the_context() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose(ids, k=1) == [3]
    assert propose(ids, k=4) == [3, 4, 5, 6]
    assert propose(ids, k=100) == [3, 4, 5, 6, 7, 8, 1, 2]  # runs up to the end, no further
    assert propose(ids, k=0) == []


def test_respects_min_n_and_max_n() -> None:
    # the 4-gram (1, 2, 3, 4) recurs, and so does the 1-gram (4,) with a different continuation
    ids = [1, 2, 3, 4, 40, 9, 4, 41, 1, 2, 3, 4]
    assert propose(ids, k=1, min_n=4, max_n=4) == [40]
    assert propose(ids, k=1, min_n=1, max_n=1) == [41]
    assert propose(ids, k=1, min_n=5, max_n=6) == []  # nothing longer than 4 recurs


def test_incremental_index_catches_up_after_several_appended_tokens() -> None:
    """One state over a growing context (as the engine uses it): after every growth of 1 to 4
    tokens the proposal equals a from-scratch brute force search."""
    rnd = random.Random(0)
    for min_n, max_n in [(1, 1), (2, 4), (1, 3), (3, 5)]:
        drafter = make(min_n, max_n)
        c = ctx([rnd.randrange(4) for _ in range(3)])
        state = drafter.begin(c)
        num_nonempty = 0
        for _ in range(150):
            for _ in range(rnd.randint(1, 4)):
                c.token_ids.append(rnd.randrange(4))  # a 4-token alphabet: plenty of matches
            k = rnd.randint(1, 6)
            got = drafter.propose(state, c, k).token_ids.tolist()
            assert got == reference(c.token_ids, k, min_n, max_n), (min_n, max_n, c.token_ids)
            drafter.commit(state, c, num_new=0, num_accepted=0)
            num_nonempty += bool(got)
        assert num_nonempty > 100


def test_proposals_from_a_stale_state_match_a_fresh_one() -> None:
    ids = [1, 2, 3, 4, 5, 1, 2]
    drafter = make()
    c = ctx(list(ids))
    state = drafter.begin(c)
    assert drafter.propose(state, c, 3).token_ids.tolist() == [3, 4, 5]
    c.token_ids += [9, 9, 4, 5, 1, 2, 9]  # (1, 2) recurs later, now followed by 9
    c.token_ids += [1, 2]
    # latest earlier (1, 2) is at 11..12, followed by 9, 1, 2
    assert drafter.propose(state, c, 3).token_ids.tolist() == reference(c.token_ids, 3, 2, 4) == [9, 1, 2]
    drafter.end(state)


def test_states_are_per_request() -> None:
    drafter = make()
    a, b = ctx([1, 2, 3, 1, 2]), ctx([1, 2, 7, 1, 2])
    sa, sb = drafter.begin(a), drafter.begin(b)
    assert drafter.propose(sa, a, 1).token_ids.tolist() == [3]
    assert drafter.propose(sb, b, 1).token_ids.tolist() == [7]
    assert drafter.propose(sa, a, 1).token_ids.tolist() == [3]


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="min_n"):
        NgramDrafterConfig(min_n=4, max_n=3)
    with pytest.raises(ValidationError, match="min_n"):
        NgramDrafterConfig(min_n=0)
    with pytest.raises(ValidationError, match="draft_len"):
        NgramDrafterConfig(draft_len=0)
    with pytest.raises(ValidationError):
        NgramDrafterConfig(unknown_field=1)
    cfg = NgramDrafterConfig(min_n=3, max_n=3)
    assert NgramDrafter(cfg).name == "ngram"
    assert NgramDrafter.needs_hidden_states is False
