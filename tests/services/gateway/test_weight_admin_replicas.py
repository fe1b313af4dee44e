"""The RL admin calls over real engine workers without Ray: each `EngineWorker` in this
process, reached the way Serve's `DeploymentHandle.broadcast` reaches every replica.

  - With API keys configured, an admin route refuses a key that is not an admin's: 403 on
    HTTP, PERMISSION_DENIED on gRPC (no key at all: 401 / UNAUTHENTICATED); an admin key
    reaches every replica.
  - An update from disk is all or nothing across replicas: replicas on models of different
    intermediate_size, a folder that fits only some; the update is reported failed naming
    the replica that refused it and why, and every replica stays on its old version and
    outputs, unpaused, nothing staged.
  - A trainer's update is checked on every replica before any joins the collective.
  - A replica that comes up while an update runs (so misses it) takes it at its end.
  - A replica that fails (its engine gone) is named, and no replica changes.
  - A role with no running replica (one died, its replacement not up) is named; the other
    roles still report their versions, and an update changes none of them.
  - An update every replica takes: one version on all, greedy equal to Hugging Face on the
    new weights; a pause the caller made before it is still there after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.engine.errors import InvalidRequestError
from baton.services.gateway.api_keys import ApiKeys
from baton.services.gateway.gateway import Gateway
from baton.services.gateway.grpc_servicers import add_admin_servicer_to_server
from baton.services.gateway.weight_admin import WeightAdmin
from baton.services.worker_calls import GenerateCall
from baton.services.workers.engine_worker import EngineWorker
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError
from testlib.grpc_inprocess import AsServeReports
from testlib.hf import hf_greedy
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
    """Replicas of one role: two on the tiny llama, one with a narrower MLP."""
    made = [
        make_worker(tiny_model("llama"), "wide-a"),
        make_worker(tiny_model("llama"), "wide-b"),
        make_worker(tiny_model("llama", intermediate_size=NARROW), "narrow"),
    ]
    yield made
    for worker in made:
        worker.shutdown()


async def greedy(worker: EngineWorker) -> tuple[list[int], str]:
    """Greedy tokens (to EOS, as Hugging Face's generate stops) and the version that made them."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, output_kind=RequestOutputKind.DELTA)
    call = GenerateCall(f"greedy-{uuid.uuid4().hex[:8]}", PROMPT, params)
    outputs = await asyncio.wait_for(collect(worker.generate(call)), 60)
    return [t for o in outputs for t in o.token_ids], outputs[-1].weight_version


async def collect(stream) -> list:
    return [output async for output in stream]


async def engine_state(worker: EngineWorker) -> tuple[bool, bool]:
    """(paused, holding a staged update)"""
    return await worker.llm.run_in_engine(lambda core: (core.weights.is_paused, core.weights.has_prepared))


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
        assert tokens and version == "0"


# -- all or nothing -----------------------------------------------------------------------


async def test_a_folder_that_fits_some_replicas_only_changes_none(workers):
    wide_a, wide_b, narrow = workers
    before = {w.worker_id: await greedy(w) for w in workers}
    admin = WeightAdmin({"colocated": Replicas(workers)})
    with pytest.raises(InvalidRequestError, match="'later' is not one of abort, wait, keep"):
        await admin.update_weights_from_disk(str(tiny_model("llama", seed=1)), pause_mode="later")
    with pytest.raises(InvalidRequestError) as refused:
        await admin.update_weights_from_disk(str(tiny_model("llama", seed=1)), "step-1")
    message = str(refused.value)
    assert f"refused by {narrow.worker_id}: " in message and "no replica changed" in message, message
    assert f"intermediate_size is 128, the running model's is {NARROW}" in message, message  # why
    assert wide_a.worker_id not in message and wide_b.worker_id not in message  # they took it
    assert await admin.weight_versions() == {w.worker_id: "0" for w in workers}
    for worker in workers:
        assert await engine_state(worker) == (False, False)  # unpaused, nothing left staged
        assert await greedy(worker) == before[worker.worker_id]
        stats = await worker.check_integrity()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_a_trainer_update_one_replica_would_refuse_is_refused_before_any_joins(workers):
    wide_a, _, narrow = workers
    shapes = {name: list(shape) for name, shape in (await layout_shapes(wide_a)).items()}
    admin = WeightAdmin({"colocated": Replicas([wide_a, narrow])})
    call = admin.update_weights_from_distributed(
        list(shapes), ["float32"] * len(shapes), list(shapes.values()), "trained", "rl"
    )
    with pytest.raises(InvalidRequestError) as refused:
        await asyncio.wait_for(call, 60)  # no replica waits in a collective for the others
    message = str(refused.value)
    assert "no replica joined the transfer" in message
    narrow_why = message.split(f"{narrow.worker_id}: ")[1]
    assert "shape" in narrow_why, message  # the narrow replica: its model's shapes
    assert "no weight update group 'rl'" in message.split(f"{wide_a.worker_id}: ")[1].split(";")[0], message
    assert await admin.weight_versions() == {wide_a.worker_id: "0", narrow.worker_id: "0"}


async def layout_shapes(worker: EngineWorker) -> dict[str, tuple[int, ...]]:
    return await worker.llm.run_in_engine(lambda core: core.executor.run_on_ranks(_layout_shapes)[0])


def _layout_shapes(rank) -> dict[str, tuple[int, ...]]:
    return dict(rank.weights.layout.shapes)


async def test_an_update_every_replica_takes_is_one_version_and_keeps_a_callers_pause(workers):
    wide = workers[:2]
    new_dir = tiny_model("llama", seed=1)
    admin = WeightAdmin({"colocated": Replicas(wide)})
    await admin.pause_generation("wait")  # an RL loop's own pause around its update
    result = await admin.update_weights_from_disk(str(new_dir), pause_mode="abort")
    assert result.ok and sorted(result.updated) == sorted(w.worker_id for w in wide)
    assert result.weight_version == "1"  # the first replica's count, taken by the other
    assert await admin.weight_versions() == {w.worker_id: "1" for w in wide}
    for worker in wide:
        assert await engine_state(worker) == (True, False)  # still the caller's pause
    await admin.continue_generation()
    expected, _ = hf_greedy(new_dir, PROMPT, MAX_TOKENS)
    for worker in wide:
        assert await greedy(worker) == (expected, "1")


class JoiningReplicas(Replicas):
    """Replicas to which Serve adds `late` while an update runs, just before the step
    `joins_at` (after the prepare step: it missed that, and the record of the update)."""

    def __init__(self, workers: list[EngineWorker], late: EngineWorker, joins_at: str) -> None:
        super().__init__(list(workers))
        self.late = late
        self.joins_at = joins_at

    def broadcast(self, method: str, *args, **kwargs) -> _Broadcast:
        if method == self.joins_at and self.late not in self.workers:
            self.workers.append(self.late)
        return super().broadcast(method, *args, **kwargs)


@pytest.mark.parametrize("joins_at", ["pause_for_update", "commit_prepared_weights"])
async def test_a_replica_that_comes_up_during_an_update_takes_it_at_its_end(workers, joins_at):
    wide = workers[:2]
    late = make_worker(tiny_model("llama"), "late")
    try:
        new_dir = tiny_model("llama", seed=2)
        admin = WeightAdmin({"colocated": JoiningReplicas(wide, late, joins_at)})
        result = await admin.update_weights_from_disk(str(new_dir), "step-2")
        assert result.ok and sorted(result.updated) == sorted(w.worker_id for w in [*wide, late]), result
        assert await admin.weight_versions() == {w.worker_id: "step-2" for w in [*wide, late]}
        expected, _ = hf_greedy(new_dir, PROMPT, MAX_TOKENS)
        assert await greedy(late) == (expected, "step-2")
        assert await engine_state(late) == (False, False)
    finally:
        late.shutdown()


class Replaced:
    """A role whose only replica died and is not yet replaced: Serve's broadcast finds no
    running replica and raises."""

    def broadcast(self, method: str, *args, **kwargs) -> _NoReplica:
        return _NoReplica()


class _NoReplica:
    async def results_async(self, return_exceptions: bool = False) -> list:
        raise DeploymentUnavailableError(DeploymentID(name="decode", app_name="baton"))


async def test_a_role_with_no_running_replica_is_named_and_the_other_roles_still_answer(workers):
    prefill = workers[0]
    before = await greedy(prefill)
    admin = WeightAdmin({"prefill": Replicas([prefill]), "decode": Replaced()})
    versions = await admin.weight_versions()
    assert versions.keys() == {prefill.worker_id, "decode (not reached)"}, versions
    assert versions[prefill.worker_id] == before[1]
    assert versions["decode (not reached)"].startswith("unknown ("), versions
    result = await admin.update_weights_from_disk(str(tiny_model("llama", seed=2)), "step-2")
    assert not result.ok and result.updated == [] and list(result.failed) == ["decode (not reached)"], result
    assert result.failed["decode (not reached)"].startswith("not prepared: ")
    assert await engine_state(prefill) == (False, False)  # nothing staged, not paused
    assert await greedy(prefill) == before


async def test_a_replica_that_fails_to_prepare_is_named_and_no_replica_changes(workers):
    wide, dead = workers[:2], workers[2]
    before = {w.worker_id: await greedy(w) for w in wide}
    (version,) = {v for _, v in before.values()}
    dead.shutdown()  # its engine is gone: a failure of the replica, not of the folder
    admin = WeightAdmin({"colocated": Replicas(workers)})
    result = await admin.update_weights_from_disk(str(tiny_model("llama", seed=2)), "step-2")
    assert not result.ok and result.updated == [] and list(result.failed) == [dead.worker_id]
    assert result.failed[dead.worker_id].startswith("not prepared: ")
    assert result.weight_version == version  # what every live replica still serves
    for worker in wide:
        assert await engine_state(worker) == (False, False)
        assert await greedy(worker) == before[worker.worker_id]
