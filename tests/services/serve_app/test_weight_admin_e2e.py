"""RL admin calls on a real deployment, disaggregated (1 prefill + 1 decode) and colocated
(local Ray, real Redis): an update from disk reaches both replicas, after it greedy outputs over HTTP and
gRPC equal Hugging Face on the new weights and report the new version; a folder of another
shape changes no replica; pause/continue and sleep/wake act on every replica."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from baton.services.client import BatonClient
from testlib.baton_client import greedy_request
from testlib.hf import hf_greedy
from testlib.local_baton import local_baton
from testlib.models import tiny_model

pytestmark = pytest.mark.ray

PROMPT = "def handler(request, context):"
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def deployment(request):
    mode = request.param
    roles = ["prefill", "decode"] if mode == "disaggregated" else ["colocated"]
    overrides = {
        "mode": mode,
        "engine": {"model": {"max_model_len": 512}, "cache": {"num_kv_blocks": 128}},
        **{role: {"ray_actor_options": {"num_cpus": 0.25}} for role in roles},
    }
    with local_baton(overrides) as deployment:
        yield deployment


def admin(deployment, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{deployment.http_address}{path}", json=body or {}, timeout=120)


def versions(deployment) -> dict:
    return httpx.get(f"{deployment.http_address}/weight_version", timeout=30).json()


def http_greedy(deployment) -> dict:
    body = {"model": "baton-tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    return httpx.post(f"{deployment.http_address}/v1/completions", json=body, timeout=60).json()


def grpc_greedy(deployment) -> tuple[list[int], str]:
    client = BatonClient(deployment.grpc_address)
    try:
        responses = list(client.generate(greedy_request(PROMPT, MAX_TOKENS), timeout=60))
    finally:
        client.close()
    return [t for r in responses for t in r.token_ids], responses[-1].weight_version


def test_an_update_from_disk_reaches_every_replica_and_matches_hf(deployment):
    new_dir = tiny_model("llama", seed=1)
    before = versions(deployment)
    num_replicas = len(deployment.config.roles)
    assert before["weight_version"] == "0" and len(before["replicas"]) == num_replicas
    answer = admin(deployment, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "step-1"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["success"] and len(answer.json()["updated"]) == num_replicas
    assert versions(deployment) == {"weight_version": "step-1", "replicas": dict.fromkeys(before["replicas"], "step-1")}

    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(new_dir).encode(PROMPT)
    expected, _ = hf_greedy(new_dir, prompt_ids, MAX_TOKENS)
    completion = http_greedy(deployment)
    assert completion["choices"][0]["token_ids"] == expected
    assert completion["weight_version"] == "step-1"
    tokens, version = grpc_greedy(deployment)
    assert tokens == expected and version == "step-1"


def test_a_folder_of_another_shape_changes_no_replica(deployment):
    before = versions(deployment)
    wider = tiny_model("llama", hidden_size=96)
    answer = admin(deployment, "/update_weights_from_disk", {"model_path": str(wider)})
    assert answer.status_code == 400, answer.text
    assert "no replica changed" in answer.json()["error"]["message"]
    assert versions(deployment) == before


def test_pause_holds_new_requests_until_continue_on_every_replica(deployment):
    assert admin(deployment, "/pause_generation", {"mode": "wait"}).json()["success"]
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", http_greedy(deployment)))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()  # held while paused
    assert admin(deployment, "/continue_generation").json()["success"]
    thread.join(timeout=60)
    assert result["r"]["choices"][0]["finish_reason"] == "length"


def test_sleep_refuses_requests_and_wake_up_serves_again(deployment):
    tokens_before, _ = grpc_greedy(deployment)
    assert admin(deployment, "/pause_generation", {"mode": "wait"}).json()["success"]
    assert admin(deployment, "/sleep", {"level": 1}).json()["success"]
    assert admin(deployment, "/continue_generation").json()["success"]
    refused = httpx.post(
        f"{deployment.http_address}/v1/completions",
        json={"model": "baton-tiny", "prompt": PROMPT, "max_tokens": 4},
        timeout=30,
    )
    assert refused.status_code >= 400 and "sleep" in refused.text.lower(), refused.text
    assert admin(deployment, "/wake_up").json()["success"]
    tokens_after, _ = grpc_greedy(deployment)
    assert tokens_after == tokens_before


def test_admin_calls_need_an_admin_key_only_when_keys_are_configured(deployment):
    # This deployment has no keys: open, as every other route. The keyed case is unit-tested
    # beside the routes (admin_http.py) with the gateway's own key checks.
    assert httpx.get(f"{deployment.http_address}/weight_version", timeout=30).status_code == 200


def test_the_grpc_admin_service(deployment):
    from baton.v1 import inference_pb2 as pb
    from baton.v1 import inference_pb2_grpc as pb_grpc

    client = BatonClient(deployment.grpc_address)
    try:
        admin = pb_grpc.AdminStub(client.channel)
        versions = admin.GetWeightVersion(pb.GetWeightVersionRequest(), metadata=client.metadata, timeout=60)
        num_replicas = len(deployment.config.roles)
        assert len(versions.replicas) == num_replicas and versions.weight_version == httpx_version(deployment)
        paused = admin.PauseGeneration(pb.PauseGenerationRequest(mode="wait"), metadata=client.metadata, timeout=60)
        assert paused.success and len(paused.replicas) == num_replicas
        resumed = admin.ContinueGeneration(pb.ContinueGenerationRequest(), metadata=client.metadata, timeout=60)
        assert resumed.success and len(resumed.replicas) == num_replicas
        with pytest.raises(grpc.RpcError) as refused:
            admin.UpdateWeightsFromDisk(
                pb.UpdateWeightsFromDiskRequest(model_path="/nonexistent/model"), metadata=client.metadata, timeout=60
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "no replica changed" in refused.value.details()
        ranks = admin.GetWeightUpdateRanks(pb.GetWeightUpdateRanksRequest(), metadata=client.metadata, timeout=60)
        assert ranks.num_engine_ranks == len(versions.replicas)
        wrong = pb.InitWeightsUpdateGroupRequest(master_address="127.0.0.1", master_port=1, world_size=99)
        with pytest.raises(grpc.RpcError) as refused:  # refused before any replica waits for a trainer
            admin.InitWeightsUpdateGroup(wrong, metadata=client.metadata, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "world_size" in refused.value.details()
    finally:
        client.close()


def httpx_version(deployment) -> str:
    return versions(deployment)["weight_version"]


def test_an_update_from_a_trainer_process_reaches_every_replica(deployment, tmp_path):
    """A real trainer process, rank 0 of a gloo group, takes a gradient step and broadcasts;
    every replica joins at the offsets the gateway assigns and receives. Disaggregated over
    HTTP, colocated over gRPC. Greedy output and logprobs then match HF on its weights."""
    from baton.v1 import inference_pb2 as pb
    from baton.v1 import inference_pb2_grpc as pb_grpc
    from testlib.weight_updates import Trainer

    ranks = httpx.get(f"{deployment.http_address}/weight_update_ranks", timeout=30).json()["num_engine_ranks"]
    trainer = Trainer(tiny_model("llama", seed=1), tmp_path / "trained", ranks + 1, bucket_bytes=64 << 20)
    over_grpc = deployment.config.mode == "colocated"
    group = {"master_address": "127.0.0.1", "master_port": trainer.port, "world_size": ranks + 1, "group_name": "rl"}
    client = BatonClient(deployment.grpc_address)
    try:
        admin_stub = pb_grpc.AdminStub(client.channel)
        if over_grpc:
            admin_stub.InitWeightsUpdateGroup(
                pb.InitWeightsUpdateGroupRequest(**group), metadata=client.metadata, timeout=120
            )
        else:
            assert admin(deployment, "/init_weights_update_group", group).json()["success"]
        meta = trainer.metadata()
        if over_grpc:
            tensors = [
                pb.TensorSpec(name=n, dtype=d, shape=s)
                for n, d, s in zip(meta["names"], meta["dtypes"], meta["shapes"])
            ]
            request = pb.UpdateWeightsFromDistributedRequest(tensors=tensors, weight_version="trained", group_name="rl")
            answer = admin_stub.UpdateWeightsFromDistributed(request, metadata=client.metadata, timeout=120)
            assert answer.success and answer.weight_version == "trained"
        else:
            body = {k: meta[k] for k in ("names", "dtypes", "shapes")} | {
                "weight_version": "trained",
                "group_name": "rl",
            }
            answer = admin(deployment, "/update_weights_from_distributed", body)
            assert answer.status_code == 200 and answer.json()["weight_version"] == "trained", answer.text
        trainer.join()
    finally:
        client.close()
    admin(deployment, "/destroy_weights_update_group", {"group_name": "rl"})
    from transformers import AutoTokenizer

    trained = tmp_path / "trained"
    prompt_ids = AutoTokenizer.from_pretrained(tiny_model("llama", seed=1)).encode(
        PROMPT
    )  # the trainer saves no tokenizer
    expected, expected_logprobs = hf_greedy(trained, prompt_ids, MAX_TOKENS)
    tokens, version = grpc_greedy(deployment)
    assert tokens == expected and version == "trained"
    body = {"model": "baton-tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    completion = httpx.post(
        f"{deployment.http_address}/v1/completions", json={**body, "logprobs": 1}, timeout=60
    ).json()
    served = completion["choices"][0]["logprobs"]["token_logprobs"]
    assert served == pytest.approx(expected_logprobs, abs=1e-3)
