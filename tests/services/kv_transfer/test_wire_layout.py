"""The wire layout: whatever the block ids on either side, the receiver's blocks end up with
exactly the sender's K/V (messages matched one to one, as gloo requires)."""

from __future__ import annotations

import pytest
import torch
from baton.services.kv_transfer import wire_layout


def caches(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(2, 40, 4, 2, 8) for _ in range(3)]


@pytest.mark.parametrize(
    "src,dst",
    [
        (list(range(5, 12)), list(range(20, 27))),  # both consecutive: zero-copy both ways
        (list(range(5, 12)), [30, 2, 3, 4, 9, 10, 11]),  # scattered destination
        ([1, 2, 3, 10, 11, 20], [7, 8, 9, 12, 13, 14]),  # a few runs
        (list(range(0, 40, 2))[:12], list(range(12, 24))),  # many runs: packed
    ],
    ids=["contiguous", "scattered-destination", "few-runs", "many-runs-packed"],
)
def test_receiver_blocks_equal_sender_blocks(src, dst):
    sender, receiver = caches(0), caches(1)
    untouched = [kv.clone() for kv in receiver]
    layout = wire_layout.choose_layout(src)
    assert layout == (
        wire_layout.PACKED if len(wire_layout.runs(src)) > wire_layout.MAX_SEGMENTS else wire_layout.SEGMENTED
    )
    messages = list(wire_layout.outgoing(sender, src, layout))
    plan = wire_layout.incoming(receiver, src, dst, layout)
    assert [m.shape for m in messages] == [buffer.shape for buffer, _ in plan]
    for message, (buffer, finish) in zip(messages, plan):
        buffer.copy_(message)  # what recv does
        if finish is not None:
            finish()
    for layer in range(3):
        assert torch.equal(receiver[layer][:, dst], sender[layer][:, src])
        others = [b for b in range(40) if b not in dst]
        assert torch.equal(receiver[layer][:, others], untouched[layer][:, others])


def test_runs():
    assert wire_layout.runs([3, 4, 5, 9, 1, 2]) == [(0, 3), (3, 1), (4, 2)]
    assert wire_layout.runs([]) == []
    # Aligned lists: a run also breaks where the other side jumps.
    assert wire_layout.runs([3, 4, 5, 6], [10, 11, 20, 21]) == [(0, 2), (2, 2)]
