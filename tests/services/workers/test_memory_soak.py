"""A bounded soak on a real local Ray cluster (1 prefill + 1 decode replica, a real
redis-server): identical rounds of 128 concurrent greedy streams. After a warm-up round the
decode replica's RSS, read idle after each round, grows by at most 5%, and once drained both
replicas have every KV block back. Without row counts padded for oneDNN, RSS grows tens of MB
per round (one oneDNN primitive per new row count, services/model/cpu_tuning.py):
527 -> 644 (warm-up) -> 714 -> 735 -> 742 -> 744 MB."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from baton.services.client import BatonClient
from testlib.baton_client import greedy_request
from testlib.local_baton import local_baton
from testlib.ray_processes import replica_pids

pytestmark = pytest.mark.ray

NUM_STREAMS = 128
MAX_TOKENS = 64
NUM_ROUNDS = 4  # after the warm-up round
MAX_GROWTH = 0.05
PROMPTS = [f"Request {i}: def handler(request, context): return {i}" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def deployment():
    overrides = {
        "mode": "disaggregated",
        "engine": {
            "model": {"max_model_len": 512},
            "cache": {"num_kv_blocks": 1024},
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 1024},
        },
        "prefill": {"ray_actor_options": {"num_cpus": 1}},
        "decode": {"ray_actor_options": {"num_cpus": 1}},
    }
    with local_baton(overrides) as deployment:
        yield deployment


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def run_round(client: BatonClient) -> None:
    errors: list[BaseException] = []
    counts: dict[str, int] = {}

    def run(prompt: str) -> None:
        try:
            responses = client.generate(greedy_request(prompt, MAX_TOKENS), timeout=120)
            counts[prompt] = sum(len(r.token_ids) for r in responses)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors[:3]
    assert counts == dict.fromkeys(PROMPTS, MAX_TOKENS)


def drained(role: str, timeout_s: float = 30) -> list:
    """The replicas' block accounting once every block of `role` is back and nothing runs."""
    from ray import serve

    handle = serve.get_deployment_handle(role, app_name="baton")
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [s for _, _, s in handle.broadcast("integrity_report").results()]
        if all(
            s.num_running == 0
            and s.num_waiting == 0
            and s.num_free_kv_blocks == s.num_kv_blocks
            and s.num_kv_leases == 0
            and s.num_kv_receiving == 0
            for s in stats
        ):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


@pytest.fixture(scope="module")
def soak(deployment):
    """Idle RSS (MB) of the decode and prefill replicas: at the start, then after each round."""
    (decode_pid,) = replica_pids("decode")
    (prefill_pid,) = replica_pids("prefill")
    client = BatonClient(deployment.grpc_address)
    samples: list[tuple[float, float]] = [(rss_mb(decode_pid), rss_mb(prefill_pid))]
    try:
        for _ in range(1 + NUM_ROUNDS):
            run_round(client)
            drained("decode")
            drained("prefill")
            time.sleep(1.0)  # idle: whatever is freed when requests end is freed by now
            samples.append((rss_mb(decode_pid), rss_mb(prefill_pid)))
    finally:
        client.close()
    decode, prefill = ([round(s[i]) for s in samples] for i in (0, 1))
    print(f"RSS MB (start, warm-up, {NUM_ROUNDS} rounds of {NUM_STREAMS} streams): decode {decode}, prefill {prefill}")
    assert replica_pids("decode") == [decode_pid], "the decode replica was replaced mid-soak"
    return [d for d, _ in samples]


def test_every_block_is_back_after_the_soak(soak):
    for role in ("decode", "prefill"):
        (stats,) = drained(role)
        assert stats.num_free_kv_blocks == stats.num_kv_blocks, (role, stats)


# Without linear()'s row padding (pad_rows_for_onednn) oneDNN's primitive caches grow with
# every new row count: decode 527 -> 636 -> 690 -> 731 -> 746 MB (+17%); with it, +1.6%.
def test_decode_rss_grows_at_most_5_percent_after_warm_up(soak):
    warm = soak[1]
    assert max(soak[2:]) <= warm * (1 + MAX_GROWTH), [round(mb) for mb in soak]
