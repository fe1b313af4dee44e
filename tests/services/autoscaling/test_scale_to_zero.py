"""Scale to zero without a cluster: the policy's demand rule and prefill-at-zero rule, Serve's
cold-start path around them (pinned: alpha), the config that allows it, and the gateway's
bounded wait for a role at zero (engine_client.guarded over router/live_replicas.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray.serve.autoscaling_policy as serve_policy_module
from baton.services.autoscaling import signals
from baton.services.autoscaling.config import AutoscalingConfig
from baton.services.autoscaling.policy import DEMAND, BatonAutoscalingPolicy, PolicyKnobs, decide
from baton.services.autoscaling.role_board import RoleBoard
from baton.services.autoscaling.scale_to_zero import cold_start_waits
from baton.services.config import BatonConfig
from baton.services.gateway.engine_client import guarded
from baton.services.router.live_replicas import LIVE_REPLICAS, LiveReplicas
from baton.services.serving_errors import NoHealthyWorkersError
from pydantic import ValidationError
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

from .test_policy import context

IDLE_DECODE = {signals.KV_USAGE: [0.0], signals.TPOT_S: [0.0]}


def test_an_idle_role_may_go_to_zero_but_not_while_it_has_requests():
    knobs = PolicyKnobs(kv_usage_target=0.5)
    idle = context("decode", 1, IDLE_DECODE, min_replicas=0, total_num_requests=0.0)
    assert decide(idle, knobs)[0].desired == 0
    # a prompt in flight reports no KV usage yet: Serve's request count keeps the replica
    busy = context("decode", 1, IDLE_DECODE, min_replicas=0, total_num_requests=0.4)
    decision, _ = decide(busy, knobs)
    assert (decision.desired, decision.signal, decision.signal_value) == (1, DEMAND, 0.4)
    # a role at zero with a call queued in a handle: one replica
    cold = context("decode", 0, {}, min_replicas=0, total_num_requests=1.0)
    assert decide(cold, knobs)[0].desired == 1


def test_prefill_at_zero_comes_back_when_prompts_queue_on_decode():
    knobs = PolicyKnobs(ttft_target_s=1.0, prefill_tokens_per_s=1000.0)
    at_zero = context("prefill", 0, {}, min_replicas=0, total_num_requests=0.0)  # it gets no calls at zero
    assert decide(at_zero, knobs)[0].desired == 0
    decision, _ = decide(at_zero, knobs, decode_waiting_prompt_tokens=2500.0)
    assert (decision.desired, decision.signal, decision.signal_value) == (3, signals.WAITING_PROMPT_TOKENS, 2500.0)
    # with replicas, its own queue is what counts, not decode's
    running = context(
        "prefill",
        1,
        {signals.WAITING_PROMPT_TOKENS: [0], signals.PREFILL_TOKENS_PER_S: [1000]},
        min_replicas=0,
        total_num_requests=0.0,
    )
    assert decide(running, knobs, decode_waiting_prompt_tokens=2500.0)[0].desired == 0


def test_the_decode_policy_posts_its_prompt_queue_for_prefill(monkeypatch):
    board = RoleBoard()
    monkeypatch.setattr("baton.services.autoscaling.role_board.BOARD", board)
    policy = BatonAutoscalingPolicy(ttft_target_s=1.0, prefill_tokens_per_s=1000.0)
    queued_on_decode = {signals.KV_USAGE: [0.2, 0.2], signals.WAITING_PROMPT_TOKENS: [1200, 600]}
    policy(context("decode", 2, queued_on_decode))
    assert board.waiting_prompt_tokens("baton", "decode") == 1800
    assert policy(context("prefill", 0, {}, min_replicas=0, total_num_requests=0.0))[0] == 2


def test_serve_starts_a_replica_at_once_for_a_queued_call(monkeypatch):
    """Serve's wrapper (alpha, pinned): at zero replicas with requests counted it answers 1
    without the upscale delay; idle at one replica it goes to zero after the down delay."""
    config = ServeAutoscalingConfig(min_replicas=0, max_replicas=2, upscale_delay_s=30, downscale_delay_s=5)
    policy = _apply_autoscaling_config(BatonAutoscalingPolicy(kv_usage_target=0.5))
    cold = context("decode", 0, {}, target=0, min_replicas=0, config=config, total_num_requests=1.0)
    assert policy(cold)[0] == 1
    state: dict = {}
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(serve_policy_module, "time", SimpleNamespace(time=lambda: clock.now))
    for at, expected in ((0.0, 1), (4.0, 1), (5.1, 0)):
        clock.now = 1000.0 + at
        idle = context(
            "decode", 1, IDLE_DECODE, target=1, min_replicas=0, config=config, state=state, total_num_requests=0.0
        )
        target, state = policy(idle)
        assert target == expected, at


def _config(**sections) -> BatonConfig:
    return BatonConfig.model_validate(
        {"engine": {"model": {"model": "/models/m"}}, "mode": "disaggregated", **sections}
    )


def test_zero_replicas_is_for_engine_roles_and_the_gateway_is_refused():
    with pytest.raises(ValidationError, match="gateway.autoscaling.min_replicas must be >= 1"):
        _config(gateway={"autoscaling": {"min_replicas": 0}})
    config = _config(
        prefill={"autoscaling": {"min_replicas": 0}},
        decode={"autoscaling": {"min_replicas": 0, "cold_start_timeout_s": 45}},
    )
    assert cold_start_waits(config) == {"decode": 45.0}  # prefill at zero runs on decode, it is not waited for
    assert cold_start_waits(_config(decode={"autoscaling": {"min_replicas": 1}})) == {}
    assert "cold_start_timeout_s" not in AutoscalingConfig(min_replicas=0).serve_config()  # Serve would refuse it
    with pytest.raises(ValidationError, match="cold_start_timeout_s"):
        AutoscalingConfig(min_replicas=0, cold_start_timeout_s=0)


def test_a_role_at_zero_is_refused_only_without_a_cold_start():
    view = LiveReplicas()
    view.publish("decode", 0)
    assert view.refuses("decode")
    view.allow_cold_start("decode", 10.0)
    assert view.has_none("decode") and not view.refuses("decode")
    with pytest.raises(ValueError, match="cold start timeout of decode"):
        view.allow_cold_start("decode", 0)


@pytest.fixture
def cold_role():
    role = "cold-test-role"  # the gateway's process-wide view, under a role no deployment has
    yield role
    LIVE_REPLICAS.forget(role)


def test_the_gateway_waits_for_a_cold_start_and_takes_its_answer(cold_role):
    LIVE_REPLICAS.publish(cold_role, 0)
    LIVE_REPLICAS.allow_cold_start(cold_role, 30.0)

    async def run():
        async def answer_once_started():
            await asyncio.sleep(0.3)
            LIVE_REPLICAS.publish(cold_role, 1)  # Serve's router sees the new replica
            await asyncio.sleep(0.2)
            return "first output"

        return await guarded(answer_once_started(), cold_role)

    assert asyncio.run(run()) == "first output"


def test_a_cold_start_longer_than_the_bound_is_a_503_with_retry_after(cold_role):
    LIVE_REPLICAS.publish(cold_role, 0)
    LIVE_REPLICAS.allow_cold_start(cold_role, 0.3)
    cancelled = []

    async def never_started():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)  # the queued call is withdrawn, not left in the handle
            raise

    with pytest.raises(NoHealthyWorkersError, match="within the 0.3 s cold-start timeout") as error:
        asyncio.run(guarded(never_started(), cold_role))
    assert error.value.retry_after_s > 0 and cancelled


def test_without_a_cold_start_a_role_at_zero_is_refused_at_once(cold_role):
    LIVE_REPLICAS.publish(cold_role, 0)

    async def first():
        return "never awaited"

    with pytest.raises(NoHealthyWorkersError, match="running right now"):
        asyncio.run(guarded(first(), cold_role))
