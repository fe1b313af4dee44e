"""Baton's autoscaling policy for Ray Serve: replicas per role from the engine's own signals.

Serve's default policy counts requests, so a prefill replica with three 8k-token prompts
queued looks as idle as one with three short ones, and a decode replica at 95% KV usage
looks fine until it preempts. This policy sizes each engine role from what its replicas
report through `record_autoscaling_stats` (signals.py), averaged by Serve over
`look_back_period_s`:

  prefill    desired = ceil(queued prompt tokens / (prefill tokens/s per replica x TTFT target))
             queued tokens are summed over the replicas; the rate is the mean of the replicas'
             measured rates (`prefill_tokens_per_s` until one is measured). The count that
             drains the whole queue within the TTFT target.
  decode     desired = ceil(current x max(KV usage / kv_usage_target, TPOT / tpot_target_s))
             mean KV usage and TPOT over the replicas: proportional control, so 2 replicas at
             twice the target want 4, and 2 at a third of it want 1. A TPOT not yet measured
             counts as on target. Preemptions above `max_preemptions_per_s` (per replica)
             want at least one replica more: the KV cache is already too small.
  colocated  the larger of the two.

Then, in this order:
  smoothing  an exponential moving average of the desired count kept in the policy state:
             s = s + smoothing x (desired - s); 1 follows the signal at once, 0.3 needs a few
             ticks (Serve calls the policy every control loop, 0.1 s) of a sustained signal.
  ratio      optional prefill:decode bound across the application: with r = prefill / decode
             held within [min_prefill_decode_ratio, max_prefill_decode_ratio], prefill is
             clamped to [floor(min x decode), ceil(max x decode)] and decode to
             [floor(prefill / max), ceil(prefill / min)], from the other role's current count
             (the controller runs both policies; see role_board.py). Set the same bound on both.
  demand     a deployment with requests (Serve's `total_num_requests`: running on its
             replicas plus queued in callers' handles, over look_back_period_s) wants at
             least 1 replica, whatever its signals say: a replica busy on a prompt reports
             no queue, and a role at zero reports nothing at all.
  bounds     [min_replicas, max_replicas] of the deployment (Serve's, capacity-adjusted).

Scale to zero (min_replicas: 0; scale_to_zero.py): with no replica left nothing reports. A
decode or colocated request waits in the gateway with its call queued in Serve's handle, which
counts in `total_num_requests` (Serve's wrapper then starts one at once, and the demand rule
says the same). Prefill at zero gets no calls (its prompts run on decode), so its rule reads
the prompt tokens waiting on the decode replicas instead (posted by decode's policy,
role_board.py): a prefill replica comes back when prompts queue there.

Delays are Serve's: Serve wraps every custom policy (ray.serve.autoscaling_policy.
_apply_autoscaling_config) and moves the target only after the decision has wanted up for
`upscale_delay_s` or down for `downscale_delay_s` without a break; tests pin that contract.

Knobs (policy_kwargs of Serve's AutoscalingPolicy; services/config.py SignalPolicyConfig):
  role                       prefill | decode | colocated; "" takes the deployment's name
  ttft_target_s              TTFT the prefill rule aims for
  prefill_tokens_per_s       prior per-replica prefill rate before one is measured
  kv_usage_target            KV usage (0..1) a decode replica aims for
  tpot_target_s              time per output token a decode replica aims for (None: KV only)
  max_preemptions_per_s      preemption rate per replica tolerated before adding one
  smoothing                  EMA weight of a new desired count, (0, 1]
  min_prefill_decode_ratio, max_prefill_decode_ratio   the ratio bound (None: unbounded)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

from .. import metrics
from . import role_board, signals

STATE_SMOOTHED = "baton_smoothed_replicas"
DEMAND = "serve_total_num_requests"  # the demand rule's signal: Serve's running + queued requests


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    role: str = ""
    ttft_target_s: float = 2.0
    prefill_tokens_per_s: float = 2000.0
    kv_usage_target: float = 0.7
    tpot_target_s: float | None = None
    max_preemptions_per_s: float = 0.0
    smoothing: float = 1.0
    min_prefill_decode_ratio: float | None = None
    max_prefill_decode_ratio: float | None = None

    def __post_init__(self) -> None:
        assert self.ttft_target_s > 0 and self.prefill_tokens_per_s > 0, self
        assert 0 < self.kv_usage_target <= 1 and 0 < self.smoothing <= 1, self


@dataclass(frozen=True, slots=True)
class Decision:
    role: str
    desired: int  # after smoothing, the ratio bound and [min, max]; before Serve's delays
    raw: float  # what the signal alone asks for
    signal: str  # the signal behind it (a signals.* key)
    signal_value: float


def _values(ctx, key: str) -> list[float]:
    """The running replicas' reported values of `key`, each averaged by Serve over
    look_back_period_s (a replica that has not reported yet is absent)."""
    return [float(v) for v in (ctx.aggregated_metrics or {}).get(key, {}).values()]


def prefill_replicas(ctx, knobs: PolicyKnobs, decode_waiting_prompt_tokens: float = 0.0) -> tuple[float, str, float]:
    """`decode_waiting_prompt_tokens`: what waits on decode, the queue while prefill is at zero."""
    queued = sum(_values(ctx, signals.WAITING_PROMPT_TOKENS))
    if ctx.current_num_replicas == 0:
        queued = decode_waiting_prompt_tokens
    rates = [r for r in _values(ctx, signals.PREFILL_TOKENS_PER_S) if r > 0]
    rate = sum(rates) / len(rates) if rates else knobs.prefill_tokens_per_s
    return math.ceil(queued / (rate * knobs.ttft_target_s)), signals.WAITING_PROMPT_TOKENS, queued


def decode_replicas(ctx, knobs: PolicyKnobs) -> tuple[float, str, float]:
    current = max(1, ctx.current_num_replicas)
    kv = _mean(_values(ctx, signals.KV_USAGE))
    pressure, signal, value = kv / knobs.kv_usage_target, signals.KV_USAGE, kv
    tpots = [t for t in _values(ctx, signals.TPOT_S) if t > 0]
    if knobs.tpot_target_s is not None and tpots:
        tpot = _mean(tpots)
        if tpot / knobs.tpot_target_s > pressure:
            pressure, signal, value = tpot / knobs.tpot_target_s, signals.TPOT_S, tpot
    desired = math.ceil(current * pressure - 1e-9)
    preemptions = _mean(_values(ctx, signals.PREEMPTIONS_PER_S))
    if preemptions > knobs.max_preemptions_per_s and desired <= ctx.current_num_replicas:
        desired, signal, value = ctx.current_num_replicas + 1, signals.PREEMPTIONS_PER_S, preemptions
    return desired, signal, value


def smooth(previous: float | None, desired: float, smoothing: float) -> float:
    return desired if previous is None else previous + smoothing * (desired - previous)


def bound_by_ratio(role: str, desired: int, peer_replicas: int | None, knobs: PolicyKnobs) -> int:
    """Holds prefill / decode within the knobs' bound, given the other role's replicas."""
    low, high = knobs.min_prefill_decode_ratio, knobs.max_prefill_decode_ratio
    if peer_replicas is None or role not in ("prefill", "decode"):
        return desired
    if role == "prefill":
        if high is not None:
            desired = min(desired, math.ceil(high * peer_replicas))
        if low is not None:
            desired = max(desired, math.floor(low * peer_replicas))
    else:
        if low is not None and low > 0:
            desired = min(desired, math.ceil(peer_replicas / low))
        if high is not None:
            desired = max(desired, math.floor(peer_replicas / high))
    return desired


def decide(
    ctx, knobs: PolicyKnobs, peer_replicas: int | None = None, decode_waiting_prompt_tokens: float = 0.0
) -> tuple[Decision, dict[str, Any]]:
    """The pure rule: context (+ the other role's replicas, and for prefill the prompt tokens
    waiting on decode) -> decision and new policy state."""
    role = knobs.role or ctx.deployment_name
    if role == "prefill":
        raw, signal, value = prefill_replicas(ctx, knobs, decode_waiting_prompt_tokens)
    elif role == "decode":
        raw, signal, value = decode_replicas(ctx, knobs)
    else:
        raw, signal, value = max(prefill_replicas(ctx, knobs), decode_replicas(ctx, knobs))
    state = dict(ctx.policy_state)
    smoothed = smooth(state.get(STATE_SMOOTHED), raw, knobs.smoothing)
    state[STATE_SMOOTHED] = smoothed
    desired = bound_by_ratio(role, math.ceil(smoothed - 1e-9), peer_replicas, knobs)
    demand = ctx.total_num_requests
    if demand > 0 and desired < 1:
        desired, raw, signal, value = 1, max(raw, 1), DEMAND, demand
    desired = min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return Decision(role, desired, float(raw), signal, float(value)), state


class BatonAutoscalingPolicy:
    """What Serve instantiates once per deployment (AutoscalingPolicy(policy_function=this
    class, policy_kwargs=knobs)) and calls every control loop with the deployment's context."""

    def __init__(self, **knobs: Any) -> None:
        self.knobs = PolicyKnobs(**knobs)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        role = self.knobs.role or ctx.deployment_name
        peer = {"prefill": "decode", "decode": "prefill"}.get(role)
        peer_replicas = role_board.BOARD.current(ctx.app_name, peer) if peer else None
        decode_waiting = role_board.BOARD.waiting_prompt_tokens(ctx.app_name, "decode") if role == "prefill" else 0.0
        decision, state = decide(ctx, self.knobs, peer_replicas, decode_waiting)
        waiting = sum(_values(ctx, signals.WAITING_PROMPT_TOKENS))
        role_board.BOARD.post(ctx.app_name, role, ctx.current_num_replicas, waiting)
        _record(decision, ctx)
        return decision.desired, state


def _record(decision: Decision, ctx) -> None:
    with contextlib.suppress(Exception):  # metrics must never stop the autoscaler (no Ray in unit tests)
        metrics.record_autoscaling(
            decision.role, decision.desired, ctx.current_num_replicas, decision.signal, decision.signal_value
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
