"""The RL admin calls over real engine workers without Ray: each `EngineWorker` in this
process, reached the way Serve's `DeploymentHandle.broadcast` reaches every replica.

  - With API keys configured, an admin route refuses a key that is not an admin's: 403 on
    HTTP, PERMISSION_DENIED on gRPC (no key at all: 401 / UNAUTHENTICATED); an admin key
    reaches every replica.
  - An update from disk is all or nothing across replicas: two replicas on models of
    different intermediate_size, a folder that fits only the first; the update is reported
    failed naming the second and why, and both stay on their old version and outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.gateway.api_keys import ApiKeys
from baton.services.gateway.gateway import Gateway
from baton.services.gateway.grpc_servicers import add_admin_servicer_to_server
from baton.services.gateway.weight_admin import WeightAdmin
from baton.services.worker_calls import GenerateCall
from baton.services.workers.engine_worker import EngineWorker
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc
from testlib.grpc_inprocess import AsServeReports
from testlib.models import tiny_model

KEY, ADMIN = "sk-weights-user-5e4d3c2b1a09", "sk-weights-admin-0a1b2c3d4e5f"
PROMPT = list(range(100, 130))
MAX_TOKENS = 8
NARROW = 96  # the second replica's intermediate_size (the tiny preset's is 128)


class Replicas:
    """One role's replicas as Serve's handle broadcasts to them: every worker's method at
    once, each one's result or the exception it raised (results_async(return_exceptions=True))."""

    def __init__(self, workers: list[EngineWorker]) -> None:
        self.workers = workers

    def broadcast(self, method: str, *args, **kwargs) -> _Broadcast:
        return _Broadcast([getattr(worker, method)(*args, **kwargs) for worker in self.workers])


class _Broadcast:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def results_async(self, return_exceptions: bool = False) -> list:
        return list(await asyncio.gather(*self.calls, return_exceptions=return_exceptions))


def make_worker(model_dir, name: str) -> EngineWorker:
    config = EngineConfig.from_kwargs(model=str(model_dir), num_kv_blocks=32, block_size=16, max_model_len=128)
    return EngineWorker("colocated", config, "tiny", replica_id=name)


@pytest.fixture(scope="module")
def workers():
    """Two replicas of one role: the tiny llama, and one with a narrower MLP."""
    made = [
        make_worker(tiny_model("llama"), "wide"),
        make_worker(tiny_model("llama", intermediate_size=NARROW), "narrow"),
    ]
    yield made
    for worker in made:
        worker.shutdown()


async def greedy(worker: EngineWorker) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    outputs = [o async for o in worker.generate(GenerateCall(f"g-{id(params)}", PROMPT, params))]
    return [t for o in outputs for t in o.token_ids], outputs[-1].weight_version


# -- admin keys ---------------------------------------------------------------------------


@pytest.fixture
def gateway(workers, fake_gateway, tokenizer_dir) -> Gateway:
    _, engine_client = fake_gateway()
    admin = WeightAdmin({"colocated": Replicas(workers)})
    return Gateway(engine_client, tokenizer_dir, api_keys=ApiKeys([KEY], [ADMIN]), weight_admin=admin)


@contextlib.asynccontextmanager
async def admin_stub(gateway: Gateway) -> AsyncIterator[pb_grpc.AdminStub]:
    """The gateway's Admin service on an in-process grpc.aio server, as Serve's proxy serves it."""
    server = grpc.aio.server()
    add_admin_servicer_to_server(AsServeReports(gateway), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.AdminStub(channel)
    finally:
        await server.stop(None)


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}  # lower case: also gRPC metadata


async def test_an_admin_route_with_keys_configured_refuses_a_key_that_is_not_an_admins(gateway, workers):
    transport = httpx.ASGITransport(app=gateway.__serve_build_asgi_app__())
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        for method, path, body in (
            ("GET", "/weight_version", None),
            ("POST", "/pause_generation", {"mode": "abort"}),
            ("POST", "/update_weights_from_disk", {"model_path": str(tiny_model("llama", seed=1))}),
        ):
            refused = await http.request(method, path, json=body, headers=bearer(KEY))
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["message"] == f"{path} needs an admin key"
            assert (await http.request(method, path, json=body)).status_code == 401  # no key at all
        answer = await http.get("/weight_version", headers=bearer(ADMIN))
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"weight_version": "0", "replicas": {w.worker_id: "0" for w in workers}}

    async with admin_stub(gateway) as admin:
        for key, code in ((KEY, grpc.StatusCode.PERMISSION_DENIED), (None, grpc.StatusCode.UNAUTHENTICATED)):
            for call, request in (
                (admin.GetWeightVersion, pb.GetWeightVersionRequest()),
                (admin.PauseGeneration, pb.PauseGenerationRequest(mode="abort")),
                (admin.UpdateWeightsFromDisk, pb.UpdateWeightsFromDiskRequest(model_path="/nonexistent")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(request, metadata=tuple(bearer(key).items()))
                assert refused.value.code() == code, refused.value.details()
        versions = await admin.GetWeightVersion(pb.GetWeightVersionRequest(), metadata=tuple(bearer(ADMIN).items()))
        assert dict(versions.replicas) == {w.worker_id: "0" for w in workers}
    for worker in workers:  # the refused pause reached no replica: both still generate
        tokens, version = await greedy(worker)
        assert len(tokens) == MAX_TOKENS and version == "0"
