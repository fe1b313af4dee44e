"""Prompt-lookup drafting: which match it picks, its bounds, and its speed on long sequences."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from baton.services.engine.spec_decode.ngram_proposer import NgramProposer


def reference_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule written out plainly: longest n first, then the earliest earlier occurrence."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_vllm_docstring_example():
    # vLLM's ngram proposer documents [1,2,3,4,2,3], min 2, max 3, k 4 -> [4, 2, 3].
    assert NgramProposer(2, 3, 4).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_longest_ngram_wins_over_an_earlier_shorter_one():
    tokens = [2, 3, 50, 9, 1, 2, 3, 60, 61, 9, 1, 2, 3]
    assert NgramProposer(1, 4, 2).propose(tokens) == [60, 61]  # [9 1 2 3] at 3, not [2 3] at 0
    assert NgramProposer(1, 2, 2).propose(tokens) == [50, 9]  # capped at 2: [2 3] first occurs at 0


def test_earliest_occurrence_of_the_longest_ngram():
    tokens = [4, 5, 10, 11, 4, 5, 20, 21, 4, 5]
    assert NgramProposer(2, 2, 2).propose(tokens) == [10, 11]


def test_max_bound_ignores_a_longer_match():
    tokens = [1, 2, 3, 10, 8, 9, 1, 2, 3, 11, 8, 9, 1, 2, 3]
    assert NgramProposer(1, 5, 1).propose(tokens) == [11]  # [8 9 1 2 3] at 4
    assert NgramProposer(1, 3, 1).propose(tokens) == [10]  # [1 2 3] at 0


def test_min_bound_rejects_a_short_match():
    tokens = [7, 1, 8, 9, 1]
    assert NgramProposer(2, 4, 3).propose(tokens) == []
    assert NgramProposer(1, 4, 3).propose(tokens) == [8, 9, 1]


def test_no_match():
    assert NgramProposer(1, 3, 4).propose([1, 2, 3, 4, 5]) == []


def test_sequences_too_short_to_match():
    proposer = NgramProposer(2, 3, 4)
    assert proposer.propose([]) == []
    assert proposer.propose([5]) == []
    assert proposer.propose([5, 5]) == []  # a 2-gram needs an earlier occurrence: 3 tokens at least
    assert proposer.propose([5, 5, 5]) == [5]


def test_k_truncated_at_the_end_of_the_sequence():
    tokens = [1, 2, 3, 4, 5, 6, 4, 5]
    assert NgramProposer(2, 2, 3).propose(tokens) == [6, 4, 5]
    assert NgramProposer(2, 2, 10).propose(tokens) == [6, 4, 5]
    assert NgramProposer(2, 2, 1).propose(tokens) == [6]


def test_a_repetition_loop_drafts_k_tokens():
    # The earliest occurrence of the suffix leaves room for k tokens; the latest, for 3.
    tokens = [9, 1, 2, 3] * 4
    assert NgramProposer(2, 3, 5).propose(tokens) == [9, 1, 2, 3, 9]


def test_overlapping_occurrence():
    assert NgramProposer(1, 2, 3).propose([5, 5, 5, 5]) == [5, 5]


def test_list_and_numpy_inputs_agree():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 1, 5, 9]
    proposer = NgramProposer(1, 3, 3)
    for array in (np.array(tokens, dtype=np.int32), np.array(tokens, dtype=np.int64)):
        drafts = proposer.propose(array)
        assert drafts == proposer.propose(tokens) == [2, 6, 1]
        assert all(type(t) is int for t in drafts)


def test_random_sequences_match_the_reference():
    rng = random.Random(0)
    for _ in range(2000):
        vocab, length = rng.randint(1, 4), rng.randint(0, 40)
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 6), rng.randint(1, 5)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        assert NgramProposer(min_n, max_n, k).propose(tokens) == reference_propose(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
            k,
        )


def test_propose_batch_is_propose_per_request():
    rng = random.Random(1)
    batch = [[rng.randrange(3) for _ in range(rng.randint(0, 30))] for _ in range(50)]
    proposer = NgramProposer(1, 3, 4)
    assert proposer.propose_batch(batch) == [proposer.propose(tokens) for tokens in batch]


def test_long_sequence_finds_a_planted_repeat():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 30_000, size=4000)
    tokens[-4:] = tokens[1200:1204]  # a 4-gram seen long ago; random tokens barely repeat 2-grams
    expected = reference_propose(tokens.tolist(), 2, 4, 5)
    assert expected == tokens[1204:1209].tolist()
    assert NgramProposer(2, 4, 5).propose(tokens) == expected


@pytest.mark.parametrize("vocab", [1, 2, 50_000])  # all-equal (every pass matches everywhere), periodic, random
def test_long_sequences_are_fast(vocab):
    tokens = np.random.default_rng(0).integers(0, vocab, size=8000)
    proposer = NgramProposer(1, 8, 5)
    proposer.propose(tokens)
    start = time.perf_counter()
    for _ in range(20):
        proposer.propose(tokens)
    per_call = (time.perf_counter() - start) / 20
    # A few hundred microseconds here; a Python loop over positions takes tens of milliseconds.
    assert per_call < 5e-3, f"{per_call * 1e3:.2f} ms per 8000-token proposal"


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 3, 2), "prompt_lookup_min must be >= 1"),
        ((3, 2, 2), r"prompt_lookup_max \(2\) must be >= prompt_lookup_min \(3\)"),
        ((1, 3, 0), "num_speculative_tokens must be >= 1"),
    ],
)
def test_bad_settings_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def test_a_batch_passed_as_one_sequence_is_refused():
    with pytest.raises(ValueError, match="token_ids must be one sequence"):
        NgramProposer(1, 3, 2).propose([[1, 2], [1, 2]])
