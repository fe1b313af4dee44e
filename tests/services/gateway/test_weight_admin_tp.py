"""The RL admin calls on a TP=2 replica (two Ray actor ranks, gloo), reached without Serve as
test_weight_admin_replicas.py reaches replicas: every step runs on both ranks.

  - a folder that fits the TP=2 replica but not a narrower one changes neither;
  - the update then reaches both ranks: greedy output equals Hugging Face on the new weights;
  - a trainer's update with one wrong shape is refused by the preflight, which runs on the
    rank actors (the check travels to them), before any rank joins a group.
"""

from __future__ import annotations

import pytest
from baton.services.engine.config import EngineConfig
from baton.services.engine.errors import InvalidRequestError
from baton.services.gateway.weight_admin import WeightAdmin
from baton.services.workers.engine_worker import EngineWorker
from safetensors import safe_open
from testlib.hf import hf_greedy
from testlib.models import tiny_model
from testlib.ray_cluster import local_ray

from .test_weight_admin_replicas import MAX_TOKENS, NARROW, PROMPT, Replicas, greedy

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def replicas():
    with local_ray(num_cpus=3):
        config = EngineConfig.from_kwargs(
            model=str(tiny_model("llama")), num_kv_blocks=32, block_size=16, max_model_len=128, tensor_parallel_size=2
        )
        tp2 = EngineWorker("colocated", config, "tiny", replica_id="tp2")
        narrow_config = EngineConfig.from_kwargs(
            model=str(tiny_model("llama", intermediate_size=NARROW)), num_kv_blocks=32, block_size=16, max_model_len=128
        )
        narrow = EngineWorker("colocated", narrow_config, "tiny", replica_id="narrow")
        try:
            yield tp2, narrow
        finally:
            tp2.shutdown()
            narrow.shutdown()


async def test_an_update_from_disk_is_all_or_nothing_and_reaches_both_ranks(replicas):
    tp2, narrow = replicas
    before = await greedy(tp2)
    new_dir = tiny_model("llama", seed=1)
    with pytest.raises(InvalidRequestError, match=f"refused by {narrow.worker_id}: .*no replica changed"):
        await WeightAdmin({"colocated": Replicas([tp2, narrow])}).update_weights_from_disk(str(new_dir), "step-1")
    assert await greedy(tp2) == before

    result = await WeightAdmin({"colocated": Replicas([tp2])}).update_weights_from_disk(str(new_dir), "step-1")
    assert result.ok and result.updated == [tp2.worker_id] and result.weight_version == "step-1"
    expected, _ = hf_greedy(new_dir, PROMPT, MAX_TOKENS)
    assert await greedy(tp2) == (expected, "step-1")


async def test_the_trainer_preflight_checks_every_rank(replicas):
    tp2, _ = replicas
    with safe_open(tiny_model("llama") / "model.safetensors", "pt") as checkpoint:  # the names a trainer sends
        shapes = {name: list(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}  # noqa: SIM118
    wrong = "model.layers.1.mlp.down_proj.weight"
    shapes[wrong] = [shapes[wrong][0], shapes[wrong][1] + 1]
    admin = WeightAdmin({"colocated": Replicas([tp2])})
    with pytest.raises(InvalidRequestError) as refused:
        await admin.update_weights_from_distributed(
            list(shapes), ["float32"] * len(shapes), list(shapes.values()), "trained", "rl"
        )
    message = str(refused.value)
    assert wrong in message and "shape" in message and "no replica joined the transfer" in message, message
    assert await admin.weight_versions() == {tp2.worker_id: "step-1"}
