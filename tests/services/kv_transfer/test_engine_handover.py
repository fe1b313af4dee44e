"""The handover between two in-process engines (prefill producer, decode consumer), over
each transport (torch.distributed with gloo; NIXL with UCX over DRAM, skipped when NIXL is
not installed): same tokens as one engine, byte-identical blocks, and every failure path
ending in a correct, recomputed answer with all blocks back."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.api.handover import Handover
from baton.services.engine.config import EngineConfig
from baton.services.engine.engine_core import EngineCore
from baton.services.kv_transfer.config import FaultInjection
from baton.services.kv_transfer.nixl_agent import load_nixl

PROMPT = list(range(100, 171))  # 71 tokens: 4 full blocks of 16 and a partial one
MAX_TOKENS = 12


@pytest.fixture(params=["torch", "nixl"])
def transport(request) -> str:
    if request.param == "nixl":
        try:
            load_nixl()
        except RuntimeError as error:
            pytest.skip(str(error))
    return request.param


@pytest.fixture
def engine(llama_dir, transport):
    """Makes engines over the transport under test; shuts them all down afterwards."""
    engines: list[EngineCore] = []

    def make(role: str, **kv) -> EngineCore:
        settings = {"num_kv_blocks": 64, "block_size": 16, "allow_fault_injection": True, **kv}
        config = EngineConfig.from_kwargs(model=str(llama_dir), role=role, transport=transport, **settings)
        engines.append(EngineCore(config))
        return engines[-1]

    yield make
    for e in engines:
        e.shutdown()


def run(engines, until, timeout_s: float = 30.0) -> dict:
    """Steps every engine until `until(finished)` holds; returns finished outputs by id."""
    finished = {}
    deadline = time.monotonic() + timeout_s
    while not until(finished):
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            for out in e.step():
                if out.finished:
                    finished[out.request_id] = out
        time.sleep(0.001)
    return finished


def prefill(p: EngineCore, request_id: str, prompt=PROMPT, seed=None):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0 if seed is None else 1.0, seed=seed)
    p.submit(p.prepare(request_id, prompt, params, handover=Handover.prefill()))
    return run([p], lambda f: request_id in f)[request_id]


def decode(d: EngineCore, p: EngineCore, request_id: str, first, prompt=PROMPT, seed=None):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0 if seed is None else 1.0, seed=seed, ignore_eos=True)
    d.submit(d.prepare(request_id, prompt, params, handover=Handover.decode(first.token_ids, first.kv_transfer_params)))
    return run([d, p], lambda f: request_id in f)[request_id]


def settle(*engines, timeout_s: float = 30.0) -> None:
    """Steps until no transfer or lease is left, then checks that every block is free."""
    deadline = time.monotonic() + timeout_s
    while any(e.needs_polling() or e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < deadline, [e.stats() for e in engines]
        for e in engines:
            e.step()
        time.sleep(0.002)
    for e in engines:
        e.check_integrity()
        assert e.scheduler.kv.num_free_blocks == e.num_kv_blocks


@pytest.fixture(scope="module")
def expected(llama_dir):
    llm = LLM(model=str(llama_dir), num_kv_blocks=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].token_ids


@pytest.fixture
def pair(engine):
    return engine("prefill"), engine("decode")


def test_handover_equals_one_engine_and_blocks_are_identical(pair, expected):
    p, d = pair
    first = prefill(p, "r1")
    params = first.kv_transfer_params
    assert params is not None and params.num_tokens == len(PROMPT) and len(params.block_ids) == 5
    out = decode(d, p, "r1", first)
    assert first.token_ids + out.token_ids == expected
    assert out.kv_path == "transferred"
    # The decode side's blocks for the prompt hold exactly the prefill side's bytes.
    received = d.scheduler.kv.pool.cached_block_hashes()
    assert len(received) >= 4  # the full prompt blocks are now in d's prefix cache
    settle(p, d)
    assert d.stats().kv_recv_ok == 1 and d.stats().kv_bytes_received > 0


def test_received_bytes_equal_sent_bytes(pair):
    p, d = pair
    first = prefill(p, "r2")
    src_blocks = torch.tensor(first.kv_transfer_params.block_ids)
    sent = [kv[:, src_blocks].clone() for kv in p.executor.rank.runner.kv_caches]
    d.submit(
        d.prepare(
            "r2",
            PROMPT,
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
            handover=Handover.decode(first.token_ids, first.kv_transfer_params),
        )
    )
    while "r2" not in d.scheduler.requests or d.scheduler.requests["r2"].kv_path is None:
        d.step()
        p.step()
    dst_blocks = torch.tensor(d.scheduler.kv.get_block_ids("r2")[:5])
    for layer, kv in enumerate(d.executor.rank.runner.kv_caches):
        got = kv[:, dst_blocks]
        # Whole blocks for the 4 full ones; the partial 5th only up to the prompt's end.
        assert torch.equal(got[:, :4], sent[layer][:, :4])
        assert torch.equal(got[:, 4, : len(PROMPT) - 64], sent[layer][:, 4, : len(PROMPT) - 64])
    run([d, p], lambda f: "r2" in f)
    settle(p, d)


def test_local_prefix_hit_transfers_only_the_rest(pair, expected):
    p, d = pair
    d.add_request("warm", PROMPT[:40], SamplingParams(max_tokens=1))  # caches two blocks of the prompt
    run([d], lambda f: "warm" in f)
    first = prefill(p, "r3")
    out = decode(d, p, "r3", first)
    assert first.token_ids + out.token_ids == expected
    assert out.num_cached_tokens == 32  # two blocks were already on the decode side
    settle(p, d)


def test_seeded_sampling_continues_across_the_handover(pair, llama_dir):
    p, d = pair
    llm = LLM(model=str(llama_dir), num_kv_blocks=64)
    one = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, ignore_eos=True))[0]
    first = prefill(p, "r4", seed=9)
    out = decode(d, p, "r4", first, seed=9)
    assert first.token_ids + out.token_ids == one.token_ids
    settle(p, d)


def test_one_decode_engine_receives_from_two_prefill_engines_at_once(engine, expected):
    """Each prefill rank is a peer of its own: concurrent receives never cross."""
    d = engine("decode", timeout_s=5.0)
    producers = [engine("prefill", timeout_s=5.0) for _ in range(2)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for round_ in range(2):  # the second round reuses both connections
        ids = [f"p{i}-{round_}" for i in range(len(producers))]
        firsts = [prefill(p, request_id) for p, request_id in zip(producers, ids)]
        for request_id, first in zip(ids, firsts):
            d.submit(
                d.prepare(
                    request_id,
                    PROMPT,
                    params,
                    handover=Handover.decode(first.token_ids, first.kv_transfer_params),
                )
            )
        outs = run([d, *producers], lambda f, ids=ids: all(i in f for i in ids))
        for request_id, first in zip(ids, firsts):
            assert first.token_ids + outs[request_id].token_ids == expected
            assert outs[request_id].kv_path == "transferred"
    settle(d, *producers)
    assert d.stats().kv_recv_ok == 4


@pytest.mark.parametrize(
    "faults,kv",
    [
        (FaultInjection(drop=True), {"timeout_s": 1.0}),
        (FaultInjection(delay_s=2.0), {"timeout_s": 0.5}),
        (FaultInjection(corrupt=True), {"verify": True}),
    ],
    ids=["dropped", "delayed-past-timeout", "corrupted-in-verify-mode"],
)
def test_failed_transfers_are_recomputed(engine, expected, faults, kv):
    p, d = engine("prefill", **kv), engine("decode", **kv)
    p.executor.set_kv_faults(faults)
    first = prefill(p, "f")
    out = decode(d, p, "f", first)
    assert first.token_ids + out.token_ids == expected
    assert out.kv_path == "recomputed"
    assert d.stats().kv_recv_failed == 1
    settle(p, d)


def test_unclaimed_lease_expires(engine):
    p = engine("prefill", lease_s=0.3)
    prefill(p, "nobody-comes")
    assert p.stats().num_kv_leases == 1
    settle(p)
    assert p.stats().kv_leases_expired == 1


def test_abort_while_receiving_frees_blocks_after_the_receive(pair):
    p, d = pair
    p.executor.set_kv_faults(FaultInjection(delay_s=0.5))
    first = prefill(p, "a")
    d.submit(
        d.prepare(
            "a",
            PROMPT,
            SamplingParams(max_tokens=MAX_TOKENS),
            handover=Handover.decode(first.token_ids, first.kv_transfer_params),
        )
    )
    d.step()  # admitted: blocks allocated, receive started
    assert d.stats().num_kv_receiving == 1
    d.abort_request("a")
    assert d.scheduler.kv.num_free_blocks < d.num_kv_blocks  # parked until the receive ends
    settle(p, d)


def test_requests_receiving_their_kv_count_against_max_num_seqs(engine, expected):
    """A receive holds a running slot from its start: when the K/V lands the request runs at
    once, and the running set never grows past max_num_seqs."""
    p, d = engine("prefill"), engine("decode", max_num_seqs=2)
    ids = [f"slot-{i}" for i in range(5)]
    firsts = {request_id: prefill(p, request_id) for request_id in ids}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for request_id, first in firsts.items():
        d.submit(
            d.prepare(request_id, PROMPT, params, handover=Handover.decode(first.token_ids, first.kv_transfer_params))
        )
    finished, most = {}, 0
    deadline = time.monotonic() + 60
    while len(finished) < len(ids):
        assert time.monotonic() < deadline
        for e in (d, p):
            finished |= {o.request_id: o for o in e.step() if o.finished}
        most = max(most, d.stats().num_running + len(d.scheduler.handover.receiving))
        time.sleep(0.001)
    assert most <= 2
    assert all(firsts[i].token_ids + finished[i].token_ids == expected for i in ids)
    settle(d, p)


def test_kv_from_other_weights_is_recomputed_not_read(engine):
    """A weight version is part of what handed-over K/V means: the decode engine, updated
    since the prefill engine computed the prompt, recomputes it on its own weights."""
    from testlib.models import tiny_model

    p, d = engine("prefill"), engine("decode")
    d.weights.update_weights_from_disk(tiny_model("llama", seed=1))  # d: version "1", p: "0"
    first = prefill(p, "other-weights")
    assert first.kv_transfer_params.weight_version == "0"
    out = decode(d, p, "other-weights", first)
    assert out.kv_path == "recomputed" and out.weight_version == "1"
    assert d.stats().kv_version_mismatches == 1 and d.stats().kv_recv_ok == 0
    assert out.token_ids == continuation(tiny_model("llama", seed=1), first.token_ids)
    p.weights.update_weights_from_disk(tiny_model("llama", seed=1))  # both on "1": transferred again
    first = prefill(p, "same-weights")
    assert decode(d, p, "same-weights", first).kv_path == "transferred"
    p.scheduler.handover.expire(float("inf"))  # the lease the first decode never claimed
    settle(d, p)


def continuation(model_dir, first_token_ids: list[int], **engine_kwargs) -> list[int]:
    """What one engine on `model_dir` generates after PROMPT + the prefill's first token."""
    reference = LLM(model=str(model_dir), num_kv_blocks=64, **engine_kwargs)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        reference.core.submit(reference.core.prepare("ref", PROMPT, params, handover=Handover.resume(first_token_ids)))
        return run([reference.core], lambda f: "ref" in f)["ref"].token_ids
    finally:
        reference.shutdown()


def test_a_bfloat16_cache_hands_over_and_another_dtype_is_recomputed_not_read(engine, llama_dir):
    """Two services with cache.kv_cache_dtype bfloat16 hand over their (half as many) bytes;
    a float32 prefill side's K/V are never read into a bfloat16 cache."""
    p, d = engine("prefill", kv_cache_dtype="bfloat16"), engine("decode", kv_cache_dtype="bfloat16")
    first = prefill(p, "bf16")
    assert first.kv_transfer_params.kv_cache_dtype == "bfloat16"
    out = decode(d, p, "bf16", first)
    assert out.kv_path == "transferred"
    assert out.token_ids == continuation(llama_dir, first.token_ids, kv_cache_dtype="bfloat16")
    p32 = engine("prefill")
    first = prefill(p32, "float32")
    out = decode(d, p32, "float32", first)
    assert out.kv_path == "recomputed" and d.stats().kv_recv_ok == 1
    assert d.stats().kv_dtype_mismatches == 1 and d.stats().kv_version_mismatches == 0
    assert out.token_ids == continuation(llama_dir, first.token_ids, kv_cache_dtype="bfloat16")
    p32.scheduler.handover.expire(float("inf"))  # the lease the decode side never claimed
    settle(d, p, p32)


def test_kv_received_across_an_update_is_recomputed_not_read(engine):
    """The decode engine is updated while it receives (the prefill side answers late): the
    K/V arrives intact, but of the old weights, so the prompt is recomputed on the new ones."""
    from testlib.models import tiny_model

    p, d = engine("prefill"), engine("decode")
    p.executor.set_kv_faults(FaultInjection(delay_s=0.5))
    first = prefill(p, "across")
    assert first.kv_transfer_params.weight_version == "0"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    d.submit(d.prepare("across", PROMPT, params, handover=Handover.decode(first.token_ids, first.kv_transfer_params)))
    d.step()
    assert d.stats().num_kv_receiving == 1  # the receive is under way
    d.weights.update_weights_from_disk(tiny_model("llama", seed=1))
    out = run([d, p], lambda f: "across" in f)["across"]
    assert out.kv_path == "recomputed" and out.weight_version == "1"
    assert d.stats().kv_version_mismatches == 1 and d.stats().kv_recv_ok == 0
    assert out.token_ids == continuation(tiny_model("llama", seed=1), first.token_ids)
    settle(d, p)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_frees_the_kv_memory_the_connector_holds_and_wake_up_hands_over_again(engine, expected):
    """Asleep, neither the runner nor the connector (NIXL: its registration) keeps the KV
    tensors: they are gone, and with them the decode side's 256 MiB of resident memory.
    Awake, each connector has the new caches: a handover transfers and matches one engine."""
    p = engine("prefill")
    d = engine("decode", num_kv_blocks=None, kv_cache_memory_bytes=256 * 2**20)
    first = prefill(p, "before")
    decode(d, p, "before", first)
    settle(p, d)
    for e in (p, d):
        kv_bytes, _ = e.weights.memory_bytes()
        old = [weakref.ref(t) for t in e.executor.rank.runner.kv_caches]
        gc.collect()
        awake = resident_bytes()
        e.weights.sleep(1)
        gc.collect()
        assert [r() for r in old] == [None] * len(old)  # no reference left anywhere
        assert e.executor.rank.connector.kv_caches == []
        if e is d:
            assert awake - resident_bytes() >= 0.9 * kv_bytes
        e.weights.wake_up()
    assert all(len(e.executor.rank.connector.kv_caches) == len(e.executor.rank.runner.kv_caches) for e in (p, d))
    first = prefill(p, "after")
    out = decode(d, p, "after", first)
    assert first.token_ids + out.token_ids == expected
    assert out.kv_path == "transferred"
    settle(p, d)
