"""Speculative decoding with a draft model through a real disaggregated Baton (one local Ray
cluster for the module): the decode side drafts with a copy of the target after the
handover, the prefill side has no drafter. Greedy output over gRPC and HTTP streaming
equals the engine without speculation (the output the same deployment gives without it:
test_disaggregated_serving.py) token for token; accepted runs arrive as deltas of several
tokens; the decode side's baton_spec_decode_* counters move in Prometheus; sleep and
wake_up through the admin API leave the draft working; target and draft blocks are all
free afterwards."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from baton.services.engine import LLM, SamplingParams
from prometheus_client.parser import text_string_to_metric_families
from testlib.baton_client import collect, greedy_request, worker_stats
from testlib.local_baton import grpc_client, local_baton
from testlib.models import tiny_model

pytestmark = pytest.mark.ray

K = 3
MAX_TOKENS = 32
PROMPTS = ["hello hello hello", "The with statement wraps a block of code. " * 6]  # the second: several blocks
NUM_DRAFT_BLOCKS = 64


@pytest.fixture(scope="module")
def deployment():
    overrides = {
        "mode": "disaggregated",
        "engine": {"model": {"max_model_len": 512}, "cache": {"num_kv_blocks": 128}},
        "prefill": {"ray_actor_options": {"num_cpus": 0.25}},
        "decode": {
            "ray_actor_options": {"num_cpus": 0.25},
            # The draft is the target's own folder: every greedy draft is accepted, the
            # mechanism's ceiling, so accepted runs are long.
            "engine_overrides": {
                "speculative": {
                    "method": "draft_model",
                    "draft_model": str(tiny_model("llama")),
                    "num_speculative_tokens": K,
                    "draft_num_kv_blocks": NUM_DRAFT_BLOCKS,
                }
            },
        },
    }
    with local_baton(overrides) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def client(deployment):
    with grpc_client(deployment) as client:
        yield client


@pytest.fixture(scope="module")
def expected():
    """Greedy tokens and text of the engine without speculation."""
    llm = LLM(model=str(tiny_model("llama")), num_kv_blocks=128, max_model_len=512)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    llm.shutdown()
    return {p: (o.token_ids, o.text) for p, o in zip(PROMPTS, outputs)}


def spec_counters(metrics_address: str, role: str) -> dict[str, float]:
    """baton_spec_decode_* counters of `role`, summed over its replicas (Ray's `ray_` prefix
    dropped; per-position series keyed `..._per_pos_total/<position>`)."""
    found: dict[str, float] = {}
    text = httpx.get(metrics_address, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("ray_baton_spec_decode_") or sample.labels.get("role") != role:
                continue
            name = sample.name.removeprefix("ray_")
            if "position" in sample.labels:
                name += f"/{sample.labels['position']}"
            found[name] = found.get(name, 0.0) + sample.value
    return found


def settle(timeout_s: float = 20.0):
    """Both sides' target blocks back to full (nothing running, leased or in flight) and the
    decode side's draft blocks all free; the stats each side's integrity check saw."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {role: worker_stats(role=role) for role in ("prefill", "decode")}
        done = all(
            s.num_free_kv_blocks == s.num_kv_blocks
            and s.num_kv_leases == 0
            and s.num_kv_receiving == 0
            and s.num_free_draft_kv_blocks == s.num_draft_kv_blocks
            for s in stats.values()
        )
        if done:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def assert_whole_runs_per_delta(per_delta: list[int], num_passes: int) -> None:
    """Each verification pass's accepted run arrives in one delta (several passes may share
    one when the client reads late; one is never split): at most a delta per pass, plus the
    prefill side's first token, the decode side's first step (no drafts yet) and a last step
    with no room for drafts. One token per delta would be MAX_TOKENS deltas."""
    assert sum(per_delta) == MAX_TOKENS and max(per_delta) > 1, per_delta
    assert num_passes > 0 and len(per_delta) <= num_passes + 3, (per_delta, num_passes)


def decode_passes() -> int:
    """Verification passes so far on the decode side (one replica)."""
    return worker_stats(role="decode").spec_num_drafts


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "several-blocks"])
def test_grpc_greedy_equals_no_speculation_and_streams_accepted_runs(client, expected, prompt):
    passes = decode_passes()
    responses = collect(client, greedy_request(prompt, MAX_TOKENS))
    assert [t for r in responses for t in r.token_ids] == expected[prompt][0]
    assert responses[-1].timings.kv_path == "transferred"  # the decode side drafted after a handover
    stats = settle()
    assert_whole_runs_per_delta(
        [len(r.token_ids) for r in responses if r.token_ids], stats["decode"].spec_num_drafts - passes
    )
    assert stats["decode"].spec_acceptance_rate == 1.0  # a draft equal to the target
    assert stats["decode"].num_draft_kv_blocks == NUM_DRAFT_BLOCKS


def test_http_stream_equals_no_speculation_with_several_tokens_per_delta(deployment, client, expected):
    prompt = PROMPTS[0]
    body = {
        "model": client.model_info().model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,  # each chunk names its tokens
        "stream": True,
    }
    passes = decode_passes()
    with httpx.stream("POST", f"{deployment.http_address}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == expected[prompt][1]
    per_delta = [len(c["logprobs"]["tokens"]) for c in choices if c.get("logprobs") and c["logprobs"]["tokens"]]
    stats = settle()
    assert_whole_runs_per_delta(per_delta, stats["decode"].spec_num_drafts - passes)


def test_spec_decode_counters_move_on_the_decode_side_only(deployment, client, expected):
    before = spec_counters(deployment.metrics_address, "decode")
    responses = collect(client, greedy_request(PROMPTS[1], MAX_TOKENS))
    assert [t for r in responses for t in r.token_ids] == expected[PROMPTS[1]][0]
    accepted = "baton_spec_decode_num_accepted_tokens_total"
    deadline = time.monotonic() + 40  # Ray exports every couple of seconds
    while (after := spec_counters(deployment.metrics_address, "decode")).get(accepted, 0) <= before.get(accepted, 0):
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.5)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert after[f"baton_spec_decode_{name}_total"] > before.get(f"baton_spec_decode_{name}_total", 0), name
    assert after["baton_spec_decode_num_accepted_tokens_per_pos_total/0"] > 0
    # The prefill side has no speculator at all (no per-position counts) and exports nothing.
    stats = settle()
    assert stats["prefill"].spec_accepted_per_position == () and stats["prefill"].num_draft_kv_blocks == 0
    assert spec_counters(deployment.metrics_address, "prefill") == {}


def test_sleep_and_wake_up_through_the_admin_api_keep_the_draft_working(deployment, client, expected):
    """Sleep and wake_up through the admin API with a draft on the decode side (that sleep
    frees its cache is shown on the engine: tests/services/engine/weight_updates): no draft
    block held while asleep; after wake_up greedy is unchanged and the draft, on its
    restored (zeroed) cache, still has every draft accepted."""
    for path, body in [("/pause_generation", {"mode": "wait"}), ("/sleep", {"level": 1}), ("/continue_generation", {})]:
        answer = httpx.post(f"{deployment.http_address}{path}", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["success"], (path, answer.text)
    asleep = settle()["decode"]
    assert asleep.num_free_draft_kv_blocks == asleep.num_draft_kv_blocks == NUM_DRAFT_BLOCKS
    assert httpx.post(f"{deployment.http_address}/wake_up", json={}, timeout=120).json()["success"]
    responses = collect(client, greedy_request(PROMPTS[1], MAX_TOKENS))
    assert [t for r in responses for t in r.token_ids] == expected[PROMPTS[1]][0]
    awake = settle()["decode"]
    drafted = awake.spec_num_draft_tokens - asleep.spec_num_draft_tokens
    assert drafted > 0 and awake.spec_num_accepted_tokens - asleep.spec_num_accepted_tokens == drafted
