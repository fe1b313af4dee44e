"""Fixtures: a running Baton (real local Ray cluster, real Redis, tiny model), once per test
module, for the end-to-end tests; and a gateway over a fake engine client, without Ray."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.services.gateway.engine_client import EngineClient
from baton.services.gateway.gateway import Gateway
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from baton.services.worker_calls import WorkerModelInfo
from testlib.models import tiny_model

MAX_WAITING = 40
FAKE_MODEL_INFO = WorkerModelInfo("tiny", 64, 16, 1, 1024, "colocated", "w@0")


class FakeEngineClient(EngineClient):
    """Streams scripted deltas, (sample index, text, finish_reason) each, and records the
    calls it gets; or raises `error` at once (after the deltas with `error_after_deltas`)."""

    def __init__(
        self,
        error: Exception | None = None,
        healthy: bool = True,
        deltas: list[tuple[int, str, str | None]] | None = None,
        model_info: WorkerModelInfo = FAKE_MODEL_INFO,
        error_after_deltas: bool = False,
    ) -> None:
        self.error = error
        self.healthy = healthy
        self.deltas = deltas or [(0, "ok", "length")]
        self.info = model_info
        self.error_after_deltas = error_after_deltas
        self.calls = []

    async def stream(self, call, trace):
        self.calls.append(call)
        if self.error is not None and not self.error_after_deltas:
            raise self.error
        for i, (index, text, finish_reason) in enumerate(self.deltas):
            completion = CompletionOutput(index, text, [5], None, None, finish_reason)
            is_last = i == len(self.deltas) - 1 and self.error is None
            yield RequestOutput(call.request_id, None, call.prompt_token_ids, [completion], is_last, 0)
        if self.error is not None:
            raise self.error

    async def resume(self, call, token_ids, trace):
        raise NotImplementedError("the fake engine client does not migrate requests")
        yield

    async def model_info(self):
        return self.info

    async def is_healthy(self):
        return self.healthy

    @property
    def roles(self):
        return ["colocated"]


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(tiny_model("llama"))


@pytest.fixture
def fake_gateway(tokenizer_dir):
    """fake_gateway(limits=None, **FakeEngineClient kwargs) -> (Gateway, its FakeEngineClient)."""

    def make(limits=None, **kwargs):
        engine_client = FakeEngineClient(**kwargs)
        return Gateway(engine_client, tokenizer_dir, limits=limits), engine_client

    return make


class FakeGrpcContext:
    def __init__(self):
        self.code, self.details, self.trailing_metadata = None, None, ()

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, metadata):
        self.trailing_metadata = tuple(metadata)


@pytest.fixture
def grpc_context() -> FakeGrpcContext:
    return FakeGrpcContext()


async def grpc_generate_failing(gateway, request) -> FakeGrpcContext:
    """Runs Generate expecting it to fail; the context holds the status it set."""
    context = FakeGrpcContext()
    with pytest.raises(Exception):  # noqa: B017 - the status is what matters; Serve wraps the exception
        async for _ in gateway.Generate(request, context):
            pass
    return context


@pytest.fixture
def grpc_failure():
    return grpc_generate_failing


@pytest.fixture(scope="module")
def baton_app():
    model = tiny_model("llama")
    config = resolve_config(
        None,
        str(model),
        {
            "mode": "colocated",
            "server": {"http_port": 0, "grpc_port": 0},
            "engine": {
                "model": {"max_model_len": 256},
                "cache": {"num_kv_blocks": 128},
                "scheduler": {"max_num_seqs": 16},
            },
            "colocated": {"max_waiting_requests": MAX_WAITING, "ray_actor_options": {"num_cpus": 1}},
        },
    )
    run_dir = Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp"))
    with LocalDeployment(config, run_dir, num_cpus=4) as deployment:
        yield deployment
