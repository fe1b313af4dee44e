"""Bitmask rows applied with torch alone equal xgrammar's own kernel, over vocab sizes that
do and do not fill their last 32-bit word, and over any subset of rows."""

from __future__ import annotations

import pytest
import torch
import xgrammar
from baton.services.engine.structured_output.bitmask import allowed_tokens, apply_bitmask, bitmask_width


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 1000, 1024, 8193])
@pytest.mark.parametrize("num_rows, rows", [(1, [0]), (4, [0, 2, 3]), (5, [4])])
def test_apply_bitmask_equals_xgrammar(vocab_size, num_rows, rows):
    generator = torch.Generator().manual_seed(vocab_size * 7 + num_rows)
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    words = bitmask_width(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=generator)
    expected = logits.clone()
    full = torch.full((num_rows, words), -1, dtype=torch.int32)  # rows left alone allow everything
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(expected, full)
    apply_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


def test_allowed_tokens_reads_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 1] = -(2**31)  # the top bit: token 63
    assert allowed_tokens(bitmask, 64).nonzero()[:, 1].tolist() == [5, 63]
