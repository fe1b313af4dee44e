"""Worker identity and load reports: ids carry the epoch; encodings round-trip; bad input is named."""

from __future__ import annotations

import pytest
from baton.services.engine import EngineStats
from baton.services.roles import Role
from baton.services.router import WorkerInfo, WorkerLoad, new_epoch

EPOCH = "0" * 24


def info(**fields) -> WorkerInfo:
    values = dict(name="prefill-0", epoch=EPOCH, role=Role.PREFILL, model="m", block_size=16, tp_size=2)
    return WorkerInfo(**(values | {"address": "app#prefill#abc"} | fields))


def test_worker_id_carries_the_epoch_and_json_round_trips():
    worker = info()
    assert worker.worker_id == f"prefill-0@{EPOCH}"
    assert WorkerInfo.from_json(worker.to_json()) == worker
    assert WorkerInfo.from_json(info(role="colocated").to_json()).role is Role.COLOCATED


def test_a_colocated_worker_of_an_older_release_reads_as_colocated():
    legacy = info(role=Role.COLOCATED).to_json().replace('"colocated"', '"both"')
    assert WorkerInfo.from_json(legacy) == info(role=Role.COLOCATED)


def test_a_colocated_worker_joins_both_role_sets():
    assert Role.COLOCATED.index_roles == ("prefill", "decode")
    assert Role.DECODE.index_roles == ("decode",)


def test_epochs_are_new_and_ordered_by_start_time():
    first, second = new_epoch(), new_epoch()
    assert first != second and first[:16] <= second[:16]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "a b"}, "worker name"),
        ({"name": "a@b"}, "worker name"),
        ({"epoch": "xyz"}, "epoch"),
        ({"role": "router"}, "router"),
        ({"block_size": 0}, "block_size"),
        ({"address": ""}, "address"),
    ],
)
def test_bad_worker_info_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        info(**fields)


def test_load_reports_encode_compactly_and_decode_back():
    load = WorkerLoad(3, 4, 512, 100, 128, 60)
    assert load.encode() == "3,4,512,100,128,60"
    assert WorkerLoad.decode(load.encode().encode()) == load
    assert load.num_requests == 7


def test_a_report_from_an_older_worker_decodes_with_defaults():
    # the first release sent five fields (no warm blocks): routers must keep reading it
    assert WorkerLoad.decode("3,4,512,100,128") == WorkerLoad(3, 4, 512, 100, 128, 0)


def test_load_comes_from_engine_stats():
    stats = EngineStats(2, 1, 40, 64, 50, 0.2, 10, 5, num_warm_free_kv_blocks=30)
    assert WorkerLoad.from_engine_stats(stats) == WorkerLoad(2, 1, 40, 50, 64, 30)


@pytest.mark.parametrize("text", ["1,2,3", "1,2,3,4,x", "1,2,3,4,-5", "1,2,3,4,5,6,7"])
def test_bad_load_reports_are_refused(text):
    with pytest.raises(ValueError):
        WorkerLoad.decode(text)
