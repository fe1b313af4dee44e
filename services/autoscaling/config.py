"""The autoscaling section of a deployment's config (services/config.py re-exports it):
Serve's `autoscaling_config` fields as Serve names them, so `baton serve` and the Helm chart
hand it to Serve as is, plus Baton's signal policy (policy.py) in Serve's `policy` shape, and
the one field Serve does not take: how long a request waits for a role scaled to zero."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_FROZEN = ConfigDict(frozen=True, extra="forbid")
SERVE_METRICS_INTERVAL_S = 10.0  # Serve's default push interval


BATON_AUTOSCALING_POLICY = "baton.services.autoscaling.policy:BatonAutoscalingPolicy"


class SignalPolicyConfig(BaseModel):
    """Knobs of Baton's signal policy (services/autoscaling/policy.py explains each rule)."""

    model_config = _FROZEN

    role: Literal["", "colocated", "prefill", "decode"] = Field(
        "", description="Which rule applies; empty: the deployment's name (its role)"
    )
    ttft_target_s: float = Field(2.0, gt=0, description="Prefill: drain the queued prompt tokens within this TTFT")
    prefill_tokens_per_s: float = Field(
        2000.0, gt=0, description="Prefill: a replica's prompt tokens/s assumed until one is measured"
    )
    kv_usage_target: float = Field(0.7, gt=0, le=1, description="Decode: KV-cache usage a replica aims for")
    tpot_target_s: float | None = Field(
        None, gt=0, description="Decode: time per output token aimed for (None: KV only)"
    )
    max_preemptions_per_s: float = Field(
        0.0, ge=0, description="Decode: preemptions/s per replica tolerated before one more replica"
    )
    smoothing: float = Field(1.0, gt=0, le=1, description="Weight of a new desired count in its moving average")
    min_prefill_decode_ratio: float | None = Field(None, ge=0, description="Lowest prefill:decode replica ratio")
    max_prefill_decode_ratio: float | None = Field(None, gt=0, description="Highest prefill:decode replica ratio")

    @model_validator(mode="after")
    def _ratio_ordered(self) -> SignalPolicyConfig:
        low, high = self.min_prefill_decode_ratio, self.max_prefill_decode_ratio
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_prefill_decode_ratio ({low}) > max_prefill_decode_ratio ({high})")
        return self


class AutoscalingPolicyConfig(BaseModel):
    """Serve's `AutoscalingPolicy`, shaped as Serve takes it (the chart passes it through)."""

    model_config = _FROZEN

    policy_function: Literal["baton.services.autoscaling.policy:BatonAutoscalingPolicy"] = Field(
        BATON_AUTOSCALING_POLICY, description="Baton's signal policy"
    )
    policy_kwargs: SignalPolicyConfig = Field(default_factory=SignalPolicyConfig, description="Its knobs")


class AutoscalingConfig(BaseModel):
    model_config = _FROZEN

    min_replicas: int = Field(1, ge=0, description="Fewest replicas")
    max_replicas: int = Field(4, ge=1, description="Most replicas")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Requests per replica the autoscaler aims for (Serve's policy; unused with `policy`)"
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="How long load must stay high before adding a replica")
    downscale_delay_s: float = Field(60.0, ge=0, description="How long load must stay low before removing one")
    metrics_interval_s: float | None = Field(
        None, gt=0, description="How often replicas push their signals to Serve (None: Serve's 10 s)"
    )
    look_back_period_s: float | None = Field(
        None, gt=0, description="Window Serve averages the signals over (None: Serve's 30 s)"
    )
    policy: AutoscalingPolicyConfig | None = Field(
        None,
        description="Engine roles: scale on Baton's signals (queued prompt tokens, KV usage, TPOT); None: Serve's request count",
    )
    cold_start_timeout_s: float = Field(
        60.0,
        gt=0,
        description="With min_replicas 0 (colocated, decode): how long a request waits for Serve to start a "
        "replica before it gets 503 with Retry-After; prefill at zero is served on decode instead (Baton's, not Serve's)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.look_back_period_s is not None and self.look_back_period_s <= (
            self.metrics_interval_s or SERVE_METRICS_INTERVAL_S
        ):
            raise ValueError(f"look_back_period_s ({self.look_back_period_s}) must exceed metrics_interval_s")
        return self

    def serve_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config`: the fields as Serve names them, unset ones left out."""
        return self.model_dump(exclude_none=True, exclude=BATON_ONLY_FIELDS)

    @property
    def scales_to_zero(self) -> bool:
        return self.min_replicas == 0


BATON_ONLY_FIELDS = {"cold_start_timeout_s"}  # read by the gateway, never handed to Serve


class GatewayAutoscalingConfig(AutoscalingConfig):
    """The gateway's: Serve's request count, and never zero replicas (the gateway is where a
    request for a role at zero waits, so it must be there to take it)."""

    @model_validator(mode="after")
    def _never_zero(self) -> GatewayAutoscalingConfig:
        if self.min_replicas < 1:
            raise ValueError(
                f"gateway.autoscaling.min_replicas must be >= 1, got {self.min_replicas}: the gateway takes the "
                "requests that wait for a role scaled to zero, so it cannot scale to zero itself"
            )
        return self
