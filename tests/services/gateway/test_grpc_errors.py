"""Malformed gRPC requests get INVALID_ARGUMENT saying what is wrong, the health check knows
which services exist, and rejected requests leave no traceback in Ray Serve's logs. No Ray:
an in-process grpc.aio server registered the way Serve's proxy registers Baton's services."""

from __future__ import annotations

import logging
import pickle

import grpc
import pytest
from baton.services.engine.errors import InvalidRequestError
from baton.services.gateway.grpc_servicers import MalformedMessage
from baton.services.serving_errors import QuietRejections
from baton.v1 import inference_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from testlib.grpc_inprocess import served

CORRUPT = b"\xff\xff\xff"
BAD_UTF8 = b"\x0a\x02\xc3\x28"  # field 1, a string where the request has one: two bytes that are not UTF-8
SERVING = health_pb2.HealthCheckResponse.SERVING
RPCS = [
    ("/baton.v1.Inference/Generate", True, "baton.v1.GenerateRequest"),
    ("/baton.v1.Inference/Tokenize", False, "baton.v1.TokenizeRequest"),
    ("/baton.v1.Inference/Abort", False, "baton.v1.AbortRequest"),
    ("/grpc.health.v1.Health/Check", False, "grpc.health.v1.HealthCheckRequest"),
]


async def call_raw(channel, method: str, streaming: bool, data: bytes):
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    if streaming:
        return [r async for r in channel.unary_stream(method, **identity)(data, timeout=10)]
    return await channel.unary_unary(method, **identity)(data, timeout=10)


class Recorder:
    """Records what each rpc receives; answers with empty responses."""

    def __init__(self):
        self.requests = []

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        return
        yield

    def __getattr__(self, name):
        async def unary(request, context):
            self.requests.append(request)
            response = {"Tokenize": pb.TokenizeResponse, "GetModelInfo": pb.ModelInfo, "Abort": pb.AbortResponse}
            return response.get(name, health_pb2.HealthCheckResponse)()

        return unary


@pytest.mark.parametrize("method,streaming,type_name", RPCS)
async def test_bytes_that_do_not_parse_arrive_as_malformed_messages(method, streaming, type_name):
    recorder = Recorder()
    async with served(recorder) as channel:
        for data in (CORRUPT, BAD_UTF8, b""):  # an empty message is a valid one
            await call_raw(channel, method, streaming, data)
    corrupt, bad_utf8, empty = recorder.requests
    assert corrupt == MalformedMessage(type_name, "the bytes are not a valid protobuf encoding of it")
    assert bad_utf8 == MalformedMessage(type_name, "a string field is not valid UTF-8")
    assert type(empty).DESCRIPTOR.full_name == type_name
    assert pickle.loads(pickle.dumps(bad_utf8)) == bad_utf8  # Serve's proxy pickles it to the replica


async def test_get_model_info_has_no_string_field_to_break(fake_gateway):
    method = "/baton.v1.Inference/GetModelInfo"
    async with served(fake_gateway()[0]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call_raw(channel, method, False, CORRUPT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            pb.ModelInfo.FromString(await call_raw(channel, method, False, BAD_UTF8)).model == "tiny"
        )  # unknown field


@pytest.mark.parametrize("method,streaming,type_name", RPCS)
@pytest.mark.parametrize("data", [CORRUPT, BAD_UTF8], ids=["corrupt", "bad-utf8"])
async def test_the_gateway_answers_malformed_bytes_with_invalid_argument(
    fake_gateway, method, streaming, type_name, data
):
    async with served(fake_gateway()[0]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call_raw(channel, method, streaming, data)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method,streaming,type_name", RPCS)
async def test_the_status_names_the_problem_without_internals(fake_gateway, grpc_context, method, streaming, type_name):
    gateway, engine_client = fake_gateway()
    context = grpc_context
    rpc = getattr(gateway, method.rsplit("/", 1)[1])
    malformed = MalformedMessage(type_name, "a string field is not valid UTF-8")
    with pytest.raises(Exception):  # noqa: B017 - Serve reports the status set on the context
        if streaming:
            [r async for r in rpc(malformed, context)]
        else:
            await rpc(malformed, context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == f"the request is not a valid {type_name} message: a string field is not valid UTF-8"
    assert engine_client.calls == []


@pytest.mark.parametrize(
    "service,status",
    [
        ("", health_pb2.HealthCheckResponse.SERVING),
        ("baton.v1.Inference", health_pb2.HealthCheckResponse.SERVING),
        ("grpc.health.v1.Health", health_pb2.HealthCheckResponse.SERVING),
    ],
)
async def test_health_of_served_names(fake_gateway, service, status):
    gateway, _ = fake_gateway()
    assert (await gateway.Check(health_pb2.HealthCheckRequest(service=service))).status == status
    watched = [r async for r in gateway.Watch(health_pb2.HealthCheckRequest(service=service))]
    assert [r.status for r in watched] == [status]


async def test_health_of_an_unknown_service_is_not_found(fake_gateway, grpc_context):
    gateway, _ = fake_gateway()
    context = grpc_context
    with pytest.raises(Exception):  # noqa: B017
        await gateway.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), context)
    assert context.code == grpc.StatusCode.NOT_FOUND and "no.such.Service" in context.details
    watched = [r async for r in gateway.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"))]
    assert [r.status for r in watched] == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
    async with served(gateway) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING


def serve_record(error: BaseException) -> logging.LogRecord:
    return logging.LogRecord(
        "ray.serve", logging.ERROR, __file__, 1, "Request failed.", None, (type(error), error, None)
    )


def test_serve_tracebacks_are_dropped_for_rejections_only():
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import gRPCStatusError

    rejected = gRPCStatusError(
        InvalidRequestError("prompt", "must not be empty"), grpc.StatusCode.INVALID_ARGUMENT, "x"
    )
    failed = gRPCStatusError(RuntimeError("boom"), grpc.StatusCode.INTERNAL, "boom")
    keep = QuietRejections().filter
    assert not keep(serve_record(rejected))  # the gateway replica's log
    assert not keep(serve_record(RayTaskError("f", "tb", rejected).as_instanceof_cause()))  # the proxy's log
    assert not keep(serve_record(InvalidRequestError("max_tokens", "too many")))  # a worker's log
    assert keep(serve_record(failed))
    assert keep(serve_record(RuntimeError("boom")))
    assert keep(logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "CALL baton OK", None, None))


async def test_a_grpc_rejection_logs_one_line(fake_gateway, grpc_failure, caplog):
    gateway, _ = fake_gateway()
    with caplog.at_level(logging.INFO, logger="baton.services.gateway.gateway"):
        context = await grpc_failure(gateway, pb.GenerateRequest(text=""))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    (line,) = [r for r in caplog.records if r.name == "baton.services.gateway.gateway"]
    assert line.levelno == logging.INFO and line.exc_info is None and "prompt: must not be empty" in line.getMessage()
    assert any(isinstance(f, QuietRejections) for f in logging.getLogger("ray.serve").filters)
