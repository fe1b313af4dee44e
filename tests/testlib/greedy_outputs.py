"""Greedy generations compared token for token, and a batch that shrinks as it decodes."""

from __future__ import annotations

import pytest
from baton.services.engine import SamplingParams

# Lengths differ so that requests finish on different steps: one generate call's decode
# batch shrinks 8, 7, 6, 5, 4, 3, 2, 2, 1, 1 (CUDA graph buckets, padded ones among them).
SHRINKING_PROMPTS = [
    "def foo(x):",
    "Hello",
    "The with statement wraps a block",
    "1 2 3 4",
    "a",
    "import os",
    "x = [",
    "Yes",
]
SHRINKING_MAX_TOKENS = [9, 3, 7, 5, 11, 2, 6, 4]


def shrinking_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in SHRINKING_MAX_TOKENS]


def assert_same_greedy(actual, expected, logprob_abs: float) -> None:
    """The same tokens, and each chosen token's logprob within `logprob_abs`."""
    assert [o.token_ids for o in actual] == [o.token_ids for o in expected]
    for out, ref in zip(actual, expected):
        chosen = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
        ref_chosen = [entry[token].logprob for token, entry in zip(ref.token_ids, ref.logprobs)]
        assert chosen == pytest.approx(ref_chosen, abs=logprob_abs)
