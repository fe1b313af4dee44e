"""Property-based fuzzing of the gRPC API of a real Baton (colocated, tiny model), through
Ray Serve's gRPC proxy with a generic channel (raw bytes in, raw bytes out): well-formed
messages with any field values, random bytes, truncated and mutated encodings, strings that
are not UTF-8, unknown methods and services. Every call succeeds with a response of its
type or fails with a client-error code and details that carry no internals (never UNKNOWN
or INTERNAL); afterwards the server is healthy and its greedy output for a fixed prompt is
what it was before.
"""

from __future__ import annotations

import grpc
import pytest
from baton.v1 import inference_pb2 as pb
from grpc_health.v1 import health_pb2
from hypothesis import assume, event, given
from hypothesis import strategies as st

from .fuzz_strategies import (
    FIXED_PROMPT,
    fuzz_settings,
    internals_in,
    messages_of,
    mutated_bytes,
    unparseable,
)

pytestmark = pytest.mark.ray
METADATA = (("application", "baton"),)
CLIENT_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
INFERENCE = pb.DESCRIPTOR.services_by_name["Inference"]
ADMIN = pb.DESCRIPTOR.services_by_name["Admin"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
# Every served rpc: /service/method -> its descriptor. Admin rpcs that change the engine
# (pause, sleep, new weights, a trainer group) only get bytes they must refuse.
RPCS = {
    f"/{service.full_name}/{method.name}": method
    for service in (INFERENCE, ADMIN, HEALTH)
    for method in service.methods
    if method.full_name != "grpc.health.v1.Health.List"  # not served
}
HARMLESS = sorted(
    path for path in RPCS if not path.startswith("/baton.v1.Admin/") or path.endswith("/GetWeightVersion")
)
SAMPLING = "baton.v1.SamplingParameters."
# Field values that keep generating cheap: few tokens or more than the context holds.
OVERRIDES = {
    SAMPLING + "max_tokens": st.one_of(st.integers(0, 4), st.integers(256, 2**32 - 1)),
    SAMPLING + "min_tokens": st.one_of(st.integers(0, 4), st.integers(2**20, 2**32 - 1)),
}


def encodings(method) -> st.SearchStrategy[bytes]:
    return messages_of(method.input_type, OVERRIDES).map(lambda message: message.SerializeToString())


def is_cheap(path: str, data: bytes) -> bool:
    """Whether bytes that happen to parse ask for little generation (see OVERRIDES)."""
    if not path.endswith("/Generate"):
        return True
    try:
        sampling = pb.GenerateRequest.FromString(data).sampling
    except Exception:  # noqa: BLE001 - not a message: the server refuses it
        return True
    return not sampling.HasField("max_tokens") or sampling.max_tokens <= 8 or sampling.max_tokens >= 256


@pytest.fixture(scope="module")
def channel(baton_app):
    with grpc.insecure_channel(baton_app.grpc_address) as channel:
        yield channel


def call(channel, path: str, data: bytes, streaming: bool, metadata=METADATA) -> tuple[grpc.StatusCode, str, list]:
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if streaming:
            responses = list(channel.unary_stream(path, **identity)(data, metadata=metadata, timeout=60))
        else:
            responses = [channel.unary_unary(path, **identity)(data, metadata=metadata, timeout=60)]
    except grpc.RpcError as error:
        return error.code(), error.details() or "", []
    return grpc.StatusCode.OK, "", responses


def check_call(channel, path: str, data: bytes, metadata=METADATA) -> grpc.StatusCode:
    """A response of the rpc's type, or a client-error code with details free of internals."""
    method = RPCS.get(path)
    code, details, responses = call(channel, path, data, method is not None and method.server_streaming, metadata)
    event(f"{path.rsplit('/', 1)[1]} {code.name}")  # --hypothesis-show-statistics
    if code == grpc.StatusCode.OK:
        assert method is not None, path
        response_class = pb if method.output_type.file.package == "baton.v1" else health_pb2
        for response in responses:
            getattr(response_class, method.output_type.name).FromString(response)
        return code
    assert code in CLIENT_CODES, (path, code, details, data)
    assert details and not internals_in(details), (path, code, internals_in(details), details)
    return code


def greedy_tokens(channel) -> list[int]:
    request = pb.GenerateRequest(text=FIXED_PROMPT)
    request.sampling.max_tokens, request.sampling.temperature, request.sampling.ignore_eos = 8, 0.0, True
    code, details, responses = call(channel, "/baton.v1.Inference/Generate", request.SerializeToString(), True)
    assert code == grpc.StatusCode.OK, details
    return [t for r in map(pb.GenerateResponse.FromString, responses) for t in r.token_ids]


@pytest.fixture(scope="module")
def baseline(channel) -> list[int]:
    return greedy_tokens(channel)


def test_the_server_answers_before_fuzzing(baseline):
    assert len(baseline) == 8


@st.composite
def well_formed(draw, paths: list[str]) -> tuple[str, bytes]:
    path = draw(st.sampled_from(paths))
    return path, draw(encodings(RPCS[path]))


@fuzz_settings(max_examples=220)
@given(well_formed(HARMLESS))
def test_well_formed_messages_with_any_field_values(channel, request):
    path, data = request
    check_call(channel, path, data)


@fuzz_settings(max_examples=180)
@given(st.sampled_from(HARMLESS), st.data())
def test_random_and_mutated_bytes(channel, path, data):
    valid = data.draw(encodings(RPCS[path]))
    raw = data.draw(st.one_of(st.binary(max_size=64), mutated_bytes(valid)))
    assume(is_cheap(path, raw))
    check_call(channel, path, raw)


@fuzz_settings(max_examples=150)
@given(st.sampled_from(sorted(RPCS)), st.data())
def test_bytes_no_message_can_have_are_invalid_argument(channel, path, data):
    """Every rpc, Admin's too: a string field that is not UTF-8, or a corrupt encoding."""
    method = RPCS[path]
    raw = data.draw(unparseable(method.input_type, encodings(method)))
    assert check_call(channel, path, raw) == grpc.StatusCode.INVALID_ARGUMENT


unknown_methods = st.one_of(
    st.from_regex(r"\A/baton\.v1\.(Inference|Admin)/[A-Za-z]{1,12}\Z").filter(lambda p: p not in RPCS),
    st.from_regex(r"\A/[a-z]{1,8}(\.[a-z0-9]{1,4})?\.[A-Z][a-z]{0,8}/[A-Za-z]{1,12}\Z"),
    st.sampled_from(["/grpc.health.v1.Health/List", "/baton.v1.Inference/generate", "/baton.v2.Inference/Generate"]),
)


@fuzz_settings(max_examples=60)
@given(unknown_methods, st.binary(max_size=16))
def test_unknown_methods_and_services(channel, path, raw):
    check_call(channel, path, raw)


@fuzz_settings(max_examples=45)
@given(
    st.sampled_from(HARMLESS),
    st.lists(st.tuples(st.sampled_from(["application", "authorization", "x-fuzz"]), st.text("abz -", max_size=8))),
)
def test_any_metadata(channel, path, metadata):
    """Without the application, with another one, or with junk beside it."""
    raw = pb.TokenizeRequest(text="hi").SerializeToString() if path.endswith("/Tokenize") else b""
    check_call(channel, path, raw, tuple(metadata))


def test_only_rpcs_the_gateway_implements_are_registered():
    """Serve's proxy registers Baton's services with a Mock servicer, which has every
    attribute: an rpc the gateway lacks (Health/List) must not be registered (UNIMPLEMENTED,
    not INTERNAL from the replica)."""
    from unittest import mock

    from baton.services.gateway.gateway import Gateway
    from baton.services.gateway.grpc_servicers import (
        add_admin_servicer_to_server,
        add_health_servicer_to_server,
        add_inference_servicer_to_server,
    )

    server = mock.Mock(spec=["add_generic_rpc_handlers", "add_registered_method_handlers"])
    for add in (add_inference_servicer_to_server, add_admin_servicer_to_server, add_health_servicer_to_server):
        add(mock.Mock(), server)
    registered = {name for (service, handlers), _ in server.add_registered_method_handlers.call_args_list
                  for name in handlers}  # fmt: skip
    assert registered and all(callable(getattr(Gateway, name, None)) for name in registered), registered
    assert "List" not in registered


def test_a_message_over_the_limit_is_resource_exhausted(channel):
    raw = pb.TokenizeRequest(text="x" * (4 * 1024 * 1024 + 1)).SerializeToString()
    code, details, _ = call(channel, "/baton.v1.Inference/Tokenize", raw, False)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and not internals_in(details), (code, details)


def test_the_server_is_healthy_and_unchanged_after_fuzzing(channel, baseline):
    code, details, responses = call(channel, "/grpc.health.v1.Health/Check", b"", False)
    assert code == grpc.StatusCode.OK, details
    assert health_pb2.HealthCheckResponse.FromString(responses[0]).status == health_pb2.HealthCheckResponse.SERVING
    assert greedy_tokens(channel) == baseline
