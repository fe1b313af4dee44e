"""The torch.distributed connector on its own: two connectors in one process, over gloo.
(The engine-level handover tests in test_engine_handover.py run over it too.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection

TRANSPORT = "torch"  # for conftest.connect
BLOCK_BYTES = 4 * 2 * 8 * 4


@pytest.mark.parametrize(
    "src,dst",
    [
        ([5, 6, 7, 8, 20, 21], [30, 2, 3, 4, 9, 10]),  # two runs, a scattered destination
        (list(range(0, 40, 2))[:12], list(range(12, 24))),  # many runs: packed
    ],
    ids=["segmented", "packed"],
)
def test_blocks_arrive_byte_identical_and_verified(connect, src, dst, receive, outcome):
    p, d = connect(verify=True)
    untouched = [kv.clone() for kv in d.kv_caches]
    p.add_leases({"t": tuple(src)})
    for round_ in range(2):  # the second reuses the pair's group
        receive(p, d, f"r{round_}", src, dst)
        status = outcome(d)
        assert status.finished_recving == {f"r{round_}"} and not status.failed_recving
        assert status.bytes_received == 3 * 2 * len(src) * BLOCK_BYTES
    others = [b for b in range(40) if b not in dst]
    for sent, got, before in zip(p.kv_caches, d.kv_caches, untouched):
        assert torch.equal(got[:, dst], sent[:, src])
        assert torch.equal(got[:, others], before[:, others])
    time.sleep(0.05)  # the last ack reaches the producer
    assert p.poll().finished_sending == {"t"}


def test_request_for_an_ended_lease_is_refused_at_once_and_the_pair_recovers(connect, receive, outcome):
    p, d = connect(timeout_s=5.0)
    p.add_leases({"t": (1, 2)})
    p.remove_leases(["t"])
    start = time.monotonic()
    receive(p, d, "late", [1, 2], [3, 4])
    status = outcome(d)
    assert "expired" in status.failed_recving["late"]
    assert time.monotonic() - start < 2.0
    p.add_leases({"t2": (1, 2)})
    receive(p, d, "next", [1, 2], [3, 4], transfer_id="t2")  # over the pair's next generation
    assert outcome(d).finished_recving == {"next"}
    assert torch.equal(d.kv_caches[0][:, [3, 4]], p.kv_caches[0][:, [1, 2]])


def test_corrupted_transfer_fails_in_verify_mode_and_the_pair_recovers(connect, receive, outcome):
    p, d = connect(verify=True, timeout_s=1.0)
    p.add_leases({"t": (1, 2)})
    p.set_faults(FaultInjection(corrupt=True))
    receive(p, d, "bad", [1, 2], [3, 4])
    assert "checksum" in outcome(d).failed_recving["bad"]
    # The producer may still await the first ack: the next generation is a group of its own.
    p.set_faults(FaultInjection())
    receive(p, d, "good", [1, 2], [3, 4])
    assert outcome(d).finished_recving == {"good"}
    assert torch.equal(d.kv_caches[2][:, [3, 4]], p.kv_caches[2][:, [1, 2]])


def test_close_does_not_hang_with_a_receive_in_flight(connect, receive):
    p, d = connect(timeout_s=30.0)
    p.set_faults(FaultInjection(drop=True))
    p.add_leases({"t": (1,)})
    receive(p, d, "r", [1], [2])
    time.sleep(0.3)
    start = time.monotonic()
    closers = [threading.Thread(target=c.close) for c in (d, p)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(timeout=5.0)
    assert not any(closer.is_alive() for closer in closers)
    assert time.monotonic() - start < 5.0
