"""Process-level CPU tuning: serial torch in helper threads, leaving other threads alone."""

from __future__ import annotations

import threading

import pytest
import torch
from baton.services.model.cpu_tuning import run_torch_serially_in_this_thread


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
