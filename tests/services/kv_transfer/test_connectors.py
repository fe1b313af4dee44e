"""What every KV connector guarantees, checked on each transport: two connectors in one
process (conftest.py); the transport-specific tests are in test_torch_connector.py and
test_nixl_connector.py."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection

BLOCK_BYTES = 4 * 2 * 8 * 4  # block size x kv heads x head dim x float32 (conftest.CACHE_SHAPE)


@pytest.mark.parametrize(
    "src,dst",
    [
        ([5, 6, 7, 8, 20, 21], [30, 2, 3, 4, 9, 10]),  # two runs, a scattered destination
        (list(range(0, 40, 2))[:12], list(range(12, 24))),  # many runs
    ],
    ids=["segmented", "scattered"],
)
def test_blocks_arrive_byte_identical_and_verified(connect, src, dst, receive, outcome):
    p, d = connect(verify=True)
    untouched = [kv.clone() for kv in d.kv_caches]
    p.add_leases({"t": tuple(src)})
    for round_ in range(2):  # the second reuses the pair's connection
        receive(p, d, f"r{round_}", src, dst)
        status = outcome(d)
        assert status.finished_recving == {f"r{round_}"} and not status.failed_recving
        assert status.bytes_received == 3 * 2 * len(src) * BLOCK_BYTES
    others = [b for b in range(40) if b not in dst]
    for sent, got, before in zip(p.kv_caches, d.kv_caches, untouched):
        assert torch.equal(got[:, dst], sent[:, src])
        assert torch.equal(got[:, others], before[:, others])
    time.sleep(0.05)  # the last acknowledgement reaches the producer
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
    receive(p, d, "next", [1, 2], [3, 4], transfer_id="t2")
    assert outcome(d).finished_recving == {"next"}
    assert torch.equal(d.kv_caches[0][:, [3, 4]], p.kv_caches[0][:, [1, 2]])


def test_a_request_before_its_lease_is_announced_waits_for_it(connect, receive, outcome):
    """The decode side may ask before the prefill engine has told its connector about the
    lease (it does at its next step, while the first token is already on its way)."""
    p, d = connect()
    receive(p, d, "early", [1, 2], [3, 4])
    time.sleep(0.3)
    p.add_leases({"t": (1, 2)})
    assert outcome(d).finished_recving == {"early"}
    assert torch.equal(d.kv_caches[1][:, [3, 4]], p.kv_caches[1][:, [1, 2]])


def test_remove_leases_waits_for_a_send_in_flight(connect, receive, outcome):
    p, d = connect()
    p.set_faults(FaultInjection(delay_s=0.4))
    p.add_leases({"t": (1, 2)})
    receive(p, d, "r", [1, 2], [3, 4])
    time.sleep(0.2)  # claimed and pinned, the blocks not sent yet
    start = time.monotonic()
    p.remove_leases(["t"])
    assert time.monotonic() - start > 0.1  # held until the send ended
    assert outcome(d).finished_recving == {"r"}


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


def test_released_caches_are_let_go_and_new_ones_served(connect, receive, outcome):
    """Sleep: the producer's leases end (a claim is refused, its consumer recomputes) and no
    reference to its caches is left; wake: it serves the caches it registers next."""
    p, d = connect(timeout_s=5.0)
    p.add_leases({"t": (1, 2)})
    shape = p.kv_caches[0].shape
    old = [weakref.ref(kv) for kv in p.kv_caches]
    p.release_kv_caches()
    gc.collect()
    assert p.kv_caches == [] and [r() for r in old] == [None] * len(old)
    receive(p, d, "asleep", [1, 2], [3, 4])
    assert "asleep" in outcome(d).failed_recving
    p.register_kv_caches([torch.randn(shape) for _ in range(3)])
    p.add_leases({"t2": (1, 2)})
    receive(p, d, "awake", [1, 2], [3, 4], transfer_id="t2")
    assert outcome(d).finished_recving == {"awake"}
    assert torch.equal(d.kv_caches[0][:, [3, 4]], p.kv_caches[0][:, [1, 2]])
