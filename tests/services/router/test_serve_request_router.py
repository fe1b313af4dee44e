"""Prefix-aware placement inside Ray Serve: with two colocated replicas, a prompt that shares
a cached prefix goes to the replica holding it; workers register in Redis under their
replica's actor name."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from baton.services.client import BatonClient
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from testlib.baton_client import collect, greedy_request
from testlib.models import tiny_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_replicas():
    config = resolve_config(
        None,
        str(tiny_model("llama")),
        {
            "mode": "colocated",
            "server": {"http_port": 0, "grpc_port": 0},
            "engine": {"model": {"max_model_len": 256}, "cache": {"num_kv_blocks": 128}},
            "colocated": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
        },
    )
    with LocalDeployment(config, Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp")), num_cpus=4) as deployment:
        client = BatonClient(deployment.grpc_address)
        yield deployment, client
        client.close()


def test_repeated_prefixes_hit_the_replica_that_holds_them(two_replicas):
    _, client = two_replicas
    prompts = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * 8 for i in range(6)]
    for prompt in prompts:
        first = collect(client, greedy_request(prompt, 2))[-1]
        second = collect(client, greedy_request(prompt + " And then?", 2))[-1]
        assert first.usage.cached_tokens == 0
        # The second prompt shares all full blocks of the first: all of them are hits.
        assert second.usage.cached_tokens == (first.usage.prompt_tokens // 16) * 16, prompt[:12]


def test_workers_are_registered_with_their_replica_address(two_replicas):
    deployment, _ = two_replicas
    from baton.services.router.router import PrefixRouter

    router = PrefixRouter.from_config(deployment.config.router_config())
    placement = router.route_decode("probe", 8)
    addresses = {router.worker_info(w.worker_id).address for w in placement.ranked}
    assert len(addresses) == 2 and all(a.startswith("SERVE_REPLICA::baton#colocated#") for a in addresses)
