"""Process-level CPU tuning: serial torch in helper threads, leaving other threads alone; row
counts padded to a bounded set of sizes for oneDNN."""

from __future__ import annotations

import threading

import pytest
import torch
from baton.services.model.cpu_tuning import onednn_rows, pad_rows_for_onednn, run_torch_serially_in_this_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def in_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_a_helper_thread_runs_torch_serially_and_others_keep_their_threads(two_threads):
    def helper():
        took_effect = run_torch_serially_in_this_thread()
        x = torch.randn(512, 512)
        return took_effect, torch.get_num_threads(), torch.equal(x @ x, x @ x)

    took_effect, helper_threads, ok = in_thread(helper)
    assert took_effect and helper_threads == 1 and ok
    assert torch.get_num_threads() == 2  # the calling thread
    assert in_thread(torch.get_num_threads) == 2  # a new thread


def test_row_counts_map_to_a_bounded_set_of_sizes_with_little_padding():
    sizes = [onednn_rows(n) for n in range(1, 4097)]
    assert all(size >= n for n, size in zip(range(1, 4097), sizes))
    assert len(set(sizes)) == 8 + 7 + 8 * 6  # each up to 8, multiples of 8 up to 64, then eight per octave
    assert max((size - n) / n for n, size in zip(range(65, 4097), sizes[64:])) <= 0.125
    expected = {1: 1, 3: 3, 8: 8, 9: 16, 64: 64, 65: 72, 72: 72, 73: 80, 128: 128, 129: 144, 1000: 1024}
    assert {n: onednn_rows(n) for n in expected} == expected


def test_padded_rows_keep_the_rows_and_add_zeros():
    x = torch.randn(2, 5, 16)
    padded = pad_rows_for_onednn(x)
    assert padded.shape == (16, 16) and padded.is_contiguous()
    assert torch.equal(padded[:10], x.reshape(10, 16)) and not padded[10:].any()
    assert pad_rows_for_onednn(torch.randn(3, 16)).shape == (3, 16)  # small batches run unpadded
    exact = torch.randn(24, 16)
    assert pad_rows_for_onednn(exact).data_ptr() == exact.data_ptr()  # nothing to pad: no copy
