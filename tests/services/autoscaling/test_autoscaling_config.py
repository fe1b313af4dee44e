"""The typed autoscaling section and what `baton serve` hands Serve from it."""

from __future__ import annotations

import pytest
from baton.services.autoscaling import signals
from baton.services.autoscaling.config import BATON_AUTOSCALING_POLICY, AutoscalingConfig
from baton.services.autoscaling.policy import PolicyKnobs, decide
from baton.services.config import BatonConfig, EngineDeploymentConfig
from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

from .test_policy import context


def test_request_count_autoscaling_is_what_it_was():
    assert AutoscalingConfig().serve_config() == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 16.0,
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 60.0,
    }


def test_an_engine_role_with_the_signal_policy_gives_serve_its_policy():
    section = EngineDeploymentConfig(
        autoscaling={"max_replicas": 3, "look_back_period_s": 15, "policy": {"policy_kwargs": {"ttft_target_s": 0.5}}}
    )
    options = section.engine_serve_options(max_num_seqs=16)
    assert "num_replicas" not in options
    serve = ServeAutoscalingConfig(**options["autoscaling_config"])
    assert (serve.max_replicas, serve.look_back_period_s) == (3, 15)
    assert serve.policy.policy_function == BATON_AUTOSCALING_POLICY
    assert serve.policy.policy_kwargs["ttft_target_s"] == 0.5
    assert PolicyKnobs(**serve.policy.policy_kwargs).ttft_target_s == 0.5  # every knob is one PolicyKnobs takes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_usage_target": 1.5}, "kv_usage_target"),
        ({"smoothing": 0}, "smoothing"),
        ({"min_prefill_decode_ratio": 2, "max_prefill_decode_ratio": 1}, "min_prefill_decode_ratio"),
        ({"ttft": 1}, "ttft"),
    ],
)
def test_bad_knobs_are_refused_at_load(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        AutoscalingConfig(policy={"policy_kwargs": kwargs})


def test_the_gateway_cannot_take_the_signal_policy(llama_dir):
    from baton.services.serve_app.builder import build_app

    config = BatonConfig.model_validate(
        {
            "engine": {"model": {"model": str(llama_dir)}},
            "gateway": {"autoscaling": {"policy": {}}},
        }
    )
    with pytest.raises(ValueError, match="gateway.autoscaling.policy"):
        build_app(config)


def test_a_colocated_replica_takes_the_larger_of_both_rules():
    knobs = PolicyKnobs(ttft_target_s=1.0, kv_usage_target=0.5)
    queued = {signals.WAITING_PROMPT_TOKENS: [3000], signals.PREFILL_TOKENS_PER_S: [1000], signals.KV_USAGE: [0.5]}
    assert decide(context("colocated", 1, queued), knobs)[0].desired == 3  # the prompt queue
    full = {signals.WAITING_PROMPT_TOKENS: [0], signals.PREFILL_TOKENS_PER_S: [1000], signals.KV_USAGE: [1.0]}
    decision, _ = decide(context("colocated", 2, full), knobs)
    assert (decision.desired, decision.signal) == (4, signals.KV_USAGE)  # the KV cache
