"""Redis specifics: big snapshots and prompts, one slot per model, and agreement with the model."""

from __future__ import annotations

import os
import random
import threading
import time

from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot
from baton.services.router import IndexConfig, InMemoryPrefixIndex, WorkerLoad, lua_routing
from baton.services.router.prefix_index import checkpoint_positions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testlib.fake_clock import FakeClock
from testlib.router_setup import make_config, make_index, make_info

TTL_S = 60.0  # liveness is not under test here; Redis would expire it in real time


def test_snapshots_and_prompts_larger_than_one_command_chunk(redis_server):
    index = make_index(make_config(redis_server), snapshot_chunk_size=3_000)
    info = make_info("a")
    index.heartbeat(info, WorkerLoad(), TTL_S)
    hashes = hash_request_tokens(list(range(4 * 9_000)), 4)  # 9000 blocks: beyond Lua's unpack limit
    assert index.replace_blocks(info.worker_id, KVCacheSnapshot(7, frozenset(hashes)))
    assert index.cached_blocks(info.worker_id) == set(hashes)
    assert index.query("prefill", hashes)[0].num_cached_blocks == 9_000
    index.record_placement(info.worker_id, hashes, 0)
    assert index.apply_events(info.worker_id, [BlockRemoved(7, tuple(hashes[5_000:]))]).next_seq == 8
    assert index.query("prefill", hashes)[0].num_cached_blocks == 5_000  # removal drops predictions too
    index.replace_blocks(info.worker_id, KVCacheSnapshot(9, frozenset()))
    assert index.cached_blocks(info.worker_id) == set()


def assert_masks_match_sets(index) -> None:
    """The inverted index (block -> mask of slots) says exactly what the workers' sets say."""
    client = index.client
    slots = {w.decode(): int(s) for w, s in client.hgetall(index.keys.slots).items()}
    assert len(set(slots.values())) == len(slots), "two workers share a slot"
    expected: dict[bytes, set[int]] = {}
    for worker_id, slot in slots.items():
        for block in index.cached_blocks(worker_id):
            expected.setdefault(block, set()).add(slot)
    masks = client.hgetall(index.keys.blocks)
    got = {
        block: {8 * i + b for i, byte in enumerate(mask) for b in range(8) if byte >> b & 1}
        for block, mask in masks.items()
    }
    assert got == expected
    assert all(mask[-1] != 0 for mask in masks.values()), "a mask keeps a trailing zero byte"


def test_a_wiped_workers_bits_go_and_its_slot_is_reused_clean(redis_server):
    index = make_index(make_config(redis_server))
    hashes = hash_request_tokens(list(range(4 * 40)), 4)
    workers = [make_info(f"w{i}", epoch=f"{1:024x}") for i in range(10)]  # slots past one byte
    for i, info in enumerate(workers):
        index.heartbeat(info, WorkerLoad(), TTL_S)
        index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset(hashes[: 4 * i])))
    assert_masks_match_sets(index)
    assert [v.num_cached_blocks for v in index.query("prefill", hashes)] == [4 * i for i in range(10)]
    restarted = make_info("w9", epoch=f"{2:024x}")  # a new epoch wipes the old one's entries
    assert index.heartbeat(restarted, WorkerLoad(), TTL_S) == 1
    assert_masks_match_sets(index)
    assert index.client.hget(index.keys.slots, restarted.worker_id) == b"9"  # the lowest free slot
    by_id = {v.worker_id: v for v in index.query("prefill", hashes)}
    assert by_id[restarted.worker_id].num_cached_blocks == 0 and by_id[restarted.worker_id].num_stored_blocks == 0
    index.deregister(workers[3].worker_id)
    assert_masks_match_sets(index)
    assert index.apply_events(workers[5].worker_id, [AllBlocksCleared(0)]).next_seq == 1
    assert_masks_match_sets(index)
    for info in workers[:3]:
        index.deregister(info.worker_id)
    index.deregister(restarted.worker_id)
    for info in workers[4:9]:
        index.deregister(info.worker_id)
    assert index.client.exists(index.keys.blocks) == 0  # nobody holds anything: no masks left


def test_every_key_of_a_model_carries_its_hash_tag(redis_server):
    index = make_index(make_config(redis_server))
    info = make_info("a")
    index.heartbeat(info, WorkerLoad(), TTL_S)
    hashes = hash_request_tokens(list(range(16)), 4)
    index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset(hashes[:2])))
    index.record_placement(info.worker_id, hashes, 8)
    index.flush()  # placement writes are sent without waiting; KEYS runs on another connection
    keys = {k.decode() for k in index.client.keys("*")}
    assert len(keys) >= 6 and all(k.startswith("baton:{tiny}:") for k in keys)


def test_a_placement_lists_its_worker_for_the_prompts_first_block(redis_server):
    """Queries search the speculative entries of the listed workers only; the list expires a
    speculative TTL (Redis's clock) after the last placement of such a prompt."""
    config = make_config(redis_server).model_copy(update={"index": IndexConfig(speculative_ttl_s=5.0)})
    index = make_index(config)  # clock=None: Redis TIME
    a, b = make_info("a"), make_info("b")
    for info in (a, b):
        index.heartbeat(info, WorkerLoad(), TTL_S)
        index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset()))
    hashes = hash_request_tokens(list(range(16)), 4)
    index.record_placement(a.worker_id, hashes, 16)
    index.record_placement(b.worker_id, hashes[:2], 8)
    index.flush()
    listed = index.keys.predicted(hashes[0])
    assert index.client.smembers(listed) == {a.worker_id.encode(), b.worker_id.encode()}
    assert 0 < index.client.pttl(listed) <= 5000
    assert [v.num_cached_blocks for v in index.query("prefill", hashes)] == [4, 2]
    index.client.srem(listed, a.worker_id)  # unlisted: its entries are not searched
    assert [v.num_cached_blocks for v in index.query("prefill", hashes)] == [0, 2]


def test_the_server_clock_judges_expiry_when_no_clock_is_injected(redis_server):
    config = make_config(redis_server).model_copy(update={"index": IndexConfig(speculative_ttl_s=0.2)})
    index = make_index(config)  # clock=None: Redis TIME
    info = make_info("a")
    index.heartbeat(info, WorkerLoad(), TTL_S)
    index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset()))
    hashes = hash_request_tokens(list(range(16)), 4)
    index.record_placement(info.worker_id, hashes, 16)
    assert index.query("prefill", hashes)[0].num_cached_blocks == 4
    time.sleep(0.25)
    assert index.query("prefill", hashes)[0].num_cached_blocks == 0
    index.record_placement(info.worker_id, hashes[:1], 4)  # a later placement prunes expired entries
    index.flush()
    assert index.client.zcard(index.keys.worker(info.worker_id, "spec")) == 1


def test_long_prompts_with_gaps_and_predictions_agree_with_the_model(redis_server):
    """The query's search in Lua against the model's in Python, caches with holes included."""
    clock = FakeClock(1_000_000)
    redis_index = make_index(make_config(redis_server), clock=clock)
    model = InMemoryPrefixIndex(redis_index.config, clock=clock)
    info = make_info("a")
    chain = hash_request_tokens(list(range(4 * 300)), 4)
    rng = random.Random(0)
    for case in range(150):
        held = set(chain[: rng.randint(0, 300)])  # a cached prefix, then maybe gaps and strays
        for _ in range(rng.choice([0, 0, 1, 3])):
            held.discard(rng.choice(chain))
        held.update(rng.sample(chain, rng.choice([0, 0, 5])))
        placed = rng.randint(0, 300)
        credited = rng.randint(0, placed)
        for index in (redis_index, model):
            index.heartbeat(info, WorkerLoad(), TTL_S)
            index.replace_blocks(info.worker_id, KVCacheSnapshot(case, frozenset(held)))
            index.record_placement(info.worker_id, chain[:placed], 0, credited)
        for length in (300, 257, placed, 64, 9, 1):
            got = redis_index.query("prefill", chain[:length])[0].num_cached_blocks
            assert got == model.query("prefill", chain[:length])[0].num_cached_blocks, (case, length)


def test_the_scripts_checkpoints_are_the_models(redis_server):
    script = lua_routing.CHECKPOINTS + "return checkpoints(tonumber(ARGV[1]))"
    client = redis_server.client()
    for num_blocks in [*range(0, 200), 255, 256, 257, 1000, 9000]:
        assert tuple(client.eval(script, 0, num_blocks)) == checkpoint_positions(num_blocks)


# -- property: Redis and the in-memory model agree on any event stream -----------------

BLOCKS = hash_request_tokens(list(range(4 * 12)), 4)  # one chain of 12 blocks
WORKERS = ("a", "b")
block_lists = st.lists(st.integers(0, len(BLOCKS) - 1), min_size=1, max_size=5, unique=True)
worker = st.sampled_from(WORKERS)
operations = st.one_of(
    st.tuples(st.just("stored"), worker, block_lists),
    st.tuples(st.just("removed"), worker, block_lists),
    st.tuples(st.just("cleared"), worker),
    st.tuples(st.just("lose_event"), worker),  # the next sequence number is never delivered
    st.tuples(st.just("replay"), worker),  # the last batch is delivered again
    st.tuples(st.just("snapshot"), worker, st.frozensets(st.integers(0, len(BLOCKS) - 1), max_size=8)),
    st.tuples(st.just("place"), worker, st.integers(0, len(BLOCKS)), st.integers(0, 64), st.integers(0, 12)),
    st.tuples(st.just("heartbeat"), worker, st.integers(0, 5)),
    st.tuples(st.just("restart"), worker),  # a new epoch: the old one's entries are wiped
    st.tuples(st.just("advance"), st.integers(0, 2_000)),
)


def make_event(kind: str, seq: int, blocks: tuple[bytes, ...]):
    if kind == "stored":
        return BlockStored(seq, blocks, None, 4 * len(blocks))
    return BlockRemoved(seq, blocks) if kind == "removed" else AllBlocksCleared(seq)


@settings(
    max_examples=int(os.environ.get("BATON_PROPERTY_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(operations, max_size=40))
def test_redis_index_agrees_with_the_in_memory_model(shared_redis, ops):
    with shared_redis.client() as client:
        client.flushall()
    clock = FakeClock(1_000_000)
    redis_index = make_index(make_config(shared_redis), clock=clock)
    model = InMemoryPrefixIndex(redis_index.config, clock=clock)
    epochs = iter(range(1, 1_000))
    infos = {name: make_info(name, epoch=f"{next(epochs):024x}") for name in WORKERS}
    next_seq = dict.fromkeys(WORKERS, 0)
    last_batch: dict[str, list] = {name: [] for name in WORKERS}
    for index in (redis_index, model):
        for info in infos.values():
            index.heartbeat(info, WorkerLoad(), TTL_S)
            index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset()))

    def both(method, *args):
        results = [getattr(index, method)(*args) for index in (redis_index, model)]
        assert results[0] == results[1], (method, args)
        return results[0]

    for op in ops:
        kind, name = op[0], op[1] if op[0] != "advance" else None
        worker_id = infos[name].worker_id if name else None
        if kind in ("stored", "removed", "cleared"):
            event = make_event(kind, next_seq[name], tuple(BLOCKS[i] for i in op[2]) if kind != "cleared" else ())
            next_seq[name] += 1
            last_batch[name] = [event]
            both("apply_events", worker_id, [event])
        elif kind == "lose_event":
            next_seq[name] += 1
        elif kind == "replay":
            both("apply_events", worker_id, last_batch[name])
        elif kind == "snapshot":
            both("replace_blocks", worker_id, KVCacheSnapshot(next_seq[name], frozenset(BLOCKS[i] for i in op[2])))
        elif kind == "place":
            both("record_placement", worker_id, BLOCKS[: op[2]], op[3], op[4])
        elif kind == "heartbeat":
            both("heartbeat", infos[name], WorkerLoad(op[2], 0, 0, 0, 0), TTL_S)
        elif kind == "restart":
            infos[name] = make_info(name, epoch=f"{next(epochs):024x}")
            both("heartbeat", infos[name], WorkerLoad(), TTL_S)
            next_seq[name], last_batch[name] = 0, []
            both("replace_blocks", infos[name].worker_id, KVCacheSnapshot(0, frozenset()))
        else:
            clock.now += op[1]
        for name in WORKERS:
            both("cached_blocks", infos[name].worker_id)
        for length in (0, 3, 9, 11, len(BLOCKS)):  # 9 and 11 end between checkpoints
            both("query", "prefill", BLOCKS[:length])
        assert_masks_match_sets(redis_index)


def test_threads_route_on_their_own_connections_and_flush_waits_for_all(redis_server):
    index = make_index(make_config(redis_server))
    info = make_info("a")
    index.heartbeat(info, WorkerLoad(), TTL_S)
    index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset()))
    hashes = hash_request_tokens(list(range(64)), 4)
    start = threading.Barrier(4)

    def place() -> None:
        start.wait()
        for _ in range(25):
            index.query("prefill", hashes)
            index.record_placement(info.worker_id, hashes, 10)

    threads = [threading.Thread(target=place) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    index.flush()  # every thread's unanswered writes, not only this thread's
    assert len(index._channels) == 4
    view = index.query("prefill", hashes)[0]
    assert (view.num_pending_requests, view.num_pending_tokens) == (100, 1000)
