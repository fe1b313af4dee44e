"""Baton's autoscaling rules as pure functions of a constructed Serve `AutoscalingContext`,
and the Serve 2.60 contract around them (alpha: pinned here): how a custom policy is
configured, instantiated with its kwargs, wrapped with Serve's delays and bounds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray.serve.autoscaling_policy as serve_policy_module
from baton.services.autoscaling import signals
from baton.services.autoscaling.config import BATON_AUTOSCALING_POLICY, AutoscalingConfig
from baton.services.autoscaling.policy import BatonAutoscalingPolicy, PolicyKnobs, bound_by_ratio, decide
from baton.services.autoscaling.role_board import RoleBoard
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext


def replica_ids(role: str, n: int) -> list[ReplicaID]:
    return [ReplicaID(f"r{i}", DeploymentID(role, "baton")) for i in range(n)]


def context(
    role: str,
    current: int,
    per_replica: dict[str, list[float]],
    *,
    target: int | None = None,
    state: dict | None = None,
    now: float = 1000.0,
    min_replicas: int = 1,
    max_replicas: int = 8,
    config: ServeAutoscalingConfig | None = None,
    total_num_requests: float = 1.0,
) -> AutoscalingContext:
    replicas = replica_ids(role, current)
    metrics = {key: dict(zip(replicas, values)) for key, values in per_replica.items()}
    return AutoscalingContext(
        deployment_id=DeploymentID(role, "baton"),
        deployment_name=role,
        app_name="baton",
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        running_replicas=replicas,
        total_num_requests=total_num_requests,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config or ServeAutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas),
    )


def test_prefill_replicas_drain_the_queued_tokens_within_the_ttft_target():
    knobs = PolicyKnobs(ttft_target_s=1.0, prefill_tokens_per_s=100.0)
    # 2 replicas, 900 + 600 tokens queued, measured 500 tok/s each: ceil(1500 / 500) = 3
    ctx = context("prefill", 2, {signals.WAITING_PROMPT_TOKENS: [900, 600], signals.PREFILL_TOKENS_PER_S: [500, 500]})
    decision, _ = decide(ctx, knobs)
    assert (decision.desired, decision.signal, decision.signal_value) == (3, signals.WAITING_PROMPT_TOKENS, 1500)
    # nothing measured yet: the prior rate (100 tok/s) -> ceil(1500 / 100) = 15, within max 8
    ctx = context("prefill", 2, {signals.WAITING_PROMPT_TOKENS: [900, 600], signals.PREFILL_TOKENS_PER_S: [0, 0]})
    assert decide(ctx, knobs)[0].desired == 8
    # an empty queue: the minimum
    ctx = context("prefill", 3, {signals.WAITING_PROMPT_TOKENS: [0, 0, 0], signals.PREFILL_TOKENS_PER_S: [500] * 3})
    assert decide(ctx, knobs)[0].desired == 1


def test_decode_replicas_follow_kv_usage_and_tpot_against_their_targets():
    knobs = PolicyKnobs(kv_usage_target=0.5, tpot_target_s=0.1)
    ctx = context("decode", 2, {signals.KV_USAGE: [0.9, 0.7], signals.TPOT_S: [0.05, 0.05]})
    decision, _ = decide(ctx, knobs)  # mean 0.8 / 0.5 -> ceil(2 x 1.6) = 4
    assert (decision.desired, decision.signal) == (4, signals.KV_USAGE)
    ctx = context("decode", 2, {signals.KV_USAGE: [0.4, 0.4], signals.TPOT_S: [0.25, 0.25]})
    decision, _ = decide(ctx, knobs)  # TPOT at 2.5x its target dominates -> 5
    assert (decision.desired, decision.signal) == (5, signals.TPOT_S)
    ctx = context("decode", 3, {signals.KV_USAGE: [0.1, 0.1, 0.1], signals.TPOT_S: [0.0] * 3})
    assert decide(ctx, knobs)[0].desired == 1  # ceil(3 x 0.2) = 1; an unmeasured TPOT is ignored
    ctx = context("decode", 2, {signals.KV_USAGE: [0.45, 0.45], signals.PREEMPTIONS_PER_S: [0.5, 0.0]})
    decision, _ = decide(ctx, knobs)  # on target, but preempting: one more
    assert (decision.desired, decision.signal) == (3, signals.PREEMPTIONS_PER_S)


def test_smoothing_moves_the_desired_count_part_of_the_way_each_tick():
    knobs = PolicyKnobs(kv_usage_target=0.5, smoothing=0.5)
    state: dict = {}
    seen = []
    for _ in range(3):
        ctx = context("decode", 1, {signals.KV_USAGE: [0.5]}, state=state)  # wants 1
        decision, state = decide(ctx, knobs)
    for _ in range(3):
        ctx = context("decode", 1, {signals.KV_USAGE: [2.0]}, state=state)  # wants 4
        decision, state = decide(ctx, knobs)
        seen.append(decision.desired)
    assert seen == [3, 4, 4]  # 1 -> 2.5 -> 3.25 -> 3.6: ceil gives 3, 4, 4


def test_the_ratio_bound_clamps_each_role_against_the_other():
    knobs = PolicyKnobs(min_prefill_decode_ratio=0.5, max_prefill_decode_ratio=1.0)
    assert bound_by_ratio("prefill", 6, 2, knobs) == 2  # at most 1 prefill per decode
    assert bound_by_ratio("prefill", 1, 6, knobs) == 3  # at least 0.5 per decode
    assert bound_by_ratio("decode", 1, 4, knobs) == 4  # decode >= prefill / 1.0
    assert bound_by_ratio("decode", 9, 2, knobs) == 4  # decode <= prefill / 0.5
    assert bound_by_ratio("prefill", 6, None, knobs) == 6  # the peer unknown: no bound
    ctx = context("prefill", 1, {signals.WAITING_PROMPT_TOKENS: [10_000], signals.PREFILL_TOKENS_PER_S: [100]})
    assert decide(ctx, knobs, peer_replicas=2)[0].desired == 2


def test_the_policy_reads_its_peer_from_the_board(monkeypatch):
    board = RoleBoard()
    monkeypatch.setattr("baton.services.autoscaling.role_board.BOARD", board)
    policy = BatonAutoscalingPolicy(max_prefill_decode_ratio=1.0, ttft_target_s=1.0, kv_usage_target=0.5)
    queued = {signals.WAITING_PROMPT_TOKENS: [50_000], signals.PREFILL_TOKENS_PER_S: [1000]}
    assert policy(context("prefill", 1, queued))[0] == 8  # no decode count posted yet
    assert policy(context("decode", 3, {signals.KV_USAGE: [0.5] * 3}))[0] == 3
    assert board.current("baton", "decode") == 3
    assert policy(context("prefill", 1, queued))[0] == 3


def serve_config(**overrides) -> ServeAutoscalingConfig:
    ours = AutoscalingConfig(
        min_replicas=1, max_replicas=4, policy={"policy_kwargs": {"ttft_target_s": 1.0}}, **overrides
    )
    return ServeAutoscalingConfig(**ours.serve_config())


def test_serve_takes_the_typed_config_and_instantiates_the_policy_with_its_kwargs():
    config = serve_config(upscale_delay_s=5.0)
    assert config.policy.policy_function == BATON_AUTOSCALING_POLICY
    assert config.policy.policy_kwargs["ttft_target_s"] == 1.0
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    policy = _resolve_policy_callable(config.policy)  # what Serve's controller does once per deployment
    assert isinstance(policy, BatonAutoscalingPolicy) and policy.knobs.ttft_target_s == 1.0


def test_serve_applies_the_upscale_and_downscale_delays_around_the_policy(monkeypatch):
    """Serve's wrapper holds the target until the decision has wanted the same direction for
    the whole delay (measured with time.time()), and Serve's bounds apply after it."""
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(serve_policy_module, "time", SimpleNamespace(time=lambda: clock.now))
    config = serve_config(upscale_delay_s=5.0, downscale_delay_s=20.0)
    policy = _apply_autoscaling_config(BatonAutoscalingPolicy(ttft_target_s=1.0, prefill_tokens_per_s=100.0))
    busy = {signals.WAITING_PROMPT_TOKENS: [300], signals.PREFILL_TOKENS_PER_S: [100]}  # wants 3
    idle = {signals.WAITING_PROMPT_TOKENS: [0], signals.PREFILL_TOKENS_PER_S: [100]}
    state: dict = {}
    target = 1

    def tick(metrics, at: float, current: int) -> int:
        nonlocal state, target
        clock.now = 1000.0 + at
        ctx = context("prefill", current, metrics, target=target, state=state, now=clock.now, config=config)
        target, state = policy(ctx)
        return target

    assert [tick(busy, at, 1) for at in (0, 2, 4.9)] == [1, 1, 1]
    assert tick(busy, 5.1, 1) == 3  # up once it has wanted up for 5 s
    assert [tick(idle, at, 3) for at in (6, 20, 25.9)] == [3, 3, 3]
    assert tick(busy, 26.0, 3) == 3  # a busy tick in between restarts the down delay
    assert [tick(idle, at, 3) for at in (27, 46.9)] == [3, 3]
    assert tick(idle, 47.1, 3) == 1  # down after 20 s of wanting down without a break


def test_look_back_must_exceed_the_push_interval():
    with pytest.raises(ValueError, match="look_back_period_s"):
        AutoscalingConfig(metrics_interval_s=2.0, look_back_period_s=1.0)
