"""Generic gRPC clients, without Baton's generated code, can call Generate: through server
reflection, and through the shipped descriptor set (protos/baton/v1/inference.protoset)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

pytestmark = pytest.mark.ray
METHOD = "/baton.v1.Inference/Generate"
METADATA = (("application", "baton"),)


def call_generate(channel, pool) -> list:
    request_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("baton.v1.GenerateRequest"))
    response_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("baton.v1.GenerateResponse"))
    request = request_class(text="def foo(x):")
    request.sampling.max_tokens = 5
    request.sampling.temperature = 0.0
    call = channel.unary_stream(
        METHOD, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_class.FromString
    )
    return list(call(request, metadata=METADATA, timeout=30))


def test_through_server_reflection(baton_app):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(baton_app.grpc_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "baton.v1.Inference" in database.get_services()
        pool = descriptor_pool.DescriptorPool(database)
        responses = call_generate(channel, pool)
    assert sum(len(r.token_ids) for r in responses) == 5
    assert responses[-1].finish_reason == "length"


def test_through_the_descriptor_set(baton_app):
    import baton.v1

    file_set = descriptor_pb2.FileDescriptorSet.FromString(baton.v1.DESCRIPTOR_SET.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in file_set.file:
        pool.Add(file)
    with grpc.insecure_channel(baton_app.grpc_address) as channel:
        responses = call_generate(channel, pool)
    assert sum(len(r.token_ids) for r in responses) == 5
