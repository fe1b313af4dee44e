"""How the gRPC services are registered on Ray Serve's gRPC proxy (`gRPCOptions.
grpc_servicer_functions` names the two `add_*` functions here).

The generated `add_*Servicer_to_server` functions parse each request in the proxy with
`FromString`; bytes that are not a message of the rpc's type (or a string field that is not
UTF-8) then raise inside grpcio, whose answer is UNKNOWN with a Python class name. These
register the same methods with a parser that cannot raise: a request it cannot read
arrives at the gateway as a `MalformedMessage`, which the gateway answers with
INVALID_ARGUMENT saying what is wrong (`grpc_api.parsed`).

They also send a refusal's retry delay as the trailing metadata `retry-after`: Serve's proxy
drops the trailing metadata a replica sets when its rpc fails, so the delay travels in the
status details (`ErrorStatus.grpc_details`) and is copied into the trailers here, after the
proxy has set the status (`with_retry_after`).

Both functions run in the proxy's process, the only Baton code that does; they also quiet
Ray Serve's tracebacks for rejected requests there (`serving_errors.quiet_rejections`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from ..serving_errors import quiet_rejections, retry_after_of

logger = logging.getLogger(__name__)
RETRY_AFTER_KEY = "retry-after"
# The health rpcs the gateway answers (gateway.py); Health/List is not served, so it is not
# registered and the server answers UNIMPLEMENTED for it.
HEALTH_RPCS = frozenset({"Check", "Watch"})


@dataclass(frozen=True, slots=True)
class MalformedMessage:
    """A request the proxy could not parse (pickled on to the gateway replica)."""

    type_name: str  # the protobuf type the rpc takes, e.g. baton.v1.GenerateRequest
    problem: str  # what is wrong with the bytes, in words

    @property
    def message(self) -> str:
        return f"the request is not a valid {self.type_name} message: {self.problem}"


def add_inference_servicer_to_server(servicer: Any, server: Any) -> None:
    from baton.v1 import inference_pb2

    add_service(inference_pb2.DESCRIPTOR.services_by_name["Inference"], servicer, server)


def add_admin_servicer_to_server(servicer: Any, server: Any) -> None:
    from baton.v1 import inference_pb2

    add_service(inference_pb2.DESCRIPTOR.services_by_name["Admin"], servicer, server)


def add_health_servicer_to_server(servicer: Any, server: Any) -> None:
    from grpc_health.v1 import health_pb2

    add_service(health_pb2.DESCRIPTOR.services_by_name["Health"], servicer, server, HEALTH_RPCS)


def add_service(service: ServiceDescriptor, servicer: Any, server: Any, served: frozenset[str] | None = None) -> None:
    """Registers the methods of `service` named in `served` (None: all of them) as the
    generated code does, but with a tolerant request parser. `served` is what the gateway
    implements: Serve's proxy passes a Mock servicer, which has every attribute, and an rpc
    registered but not implemented fails in the replica as INTERNAL, quoting its attributes."""
    quiet_rejections()
    _wrap_serves_handlers(server)
    handlers = {
        method.name: _method_handler(method, behaviour)
        for method in service.methods
        if served is None or method.name in served
        if (behaviour := getattr(servicer, method.name, None)) is not None
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    add_registered = getattr(server, "add_registered_method_handlers", None)  # grpcio >= 1.63
    if add_registered is not None:
        add_registered(service.full_name, handlers)


def tolerant_parser(message_class: Any) -> Callable[[bytes], Any]:
    """`message_class.FromString`, returning a MalformedMessage instead of raising."""

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return MalformedMessage(message_class.DESCRIPTOR.full_name, _problem(error))

    return parse


def _method_handler(method: Any, behaviour: Callable) -> grpc.RpcMethodHandler:
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    if method.client_streaming:
        raise ValueError(f"{method.full_name}: client-streaming rpcs are not registered here")
    make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
    return make(
        with_retry_after(behaviour),
        request_deserializer=tolerant_parser(request_class),
        response_serializer=response_class.SerializeToString,
    )


def _wrap_serves_handlers(server: Any) -> None:
    """Serve's gRPC proxy server replaces every handler registered on it with one its
    `service_handler_factory` makes (keeping the request parser): the retry delay goes
    around those. Other servers (grpc.aio's own, in tests) run the handlers given here."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or getattr(factory, "baton_retry_after", False):
        return

    def retry_after_factory(*args, **kwargs):
        return with_retry_after(factory(*args, **kwargs))

    retry_after_factory.baton_retry_after = True
    server.service_handler_factory = retry_after_factory


def with_retry_after(behaviour: Callable) -> Callable:
    """`behaviour` (Serve's proxy handler), then the status details' retry delay, if any, in
    the trailing metadata. Handlers that are neither async functions nor async generators
    are left as they are."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request, context):
            try:
                async for response in behaviour(request, context):
                    yield response
            finally:
                _add_retry_after(context)

        return stream
    if inspect.iscoroutinefunction(behaviour):

        async def unary(request, context):
            try:
                return await behaviour(request, context)
            finally:
                _add_retry_after(context)

        return unary
    return behaviour


def _add_retry_after(context: Any) -> None:
    try:
        code = context.code()
        if code in (None, grpc.StatusCode.OK, 0):
            return
        seconds = retry_after_of(context.details())
        if seconds is None:
            return
        trailing = tuple(context.trailing_metadata() or ())
        if any(key == RETRY_AFTER_KEY for key, _ in trailing):
            return
        context.set_trailing_metadata((*trailing, (RETRY_AFTER_KEY, str(seconds))))
    except Exception:  # a context that cannot say or take it: the details still carry the delay
        logger.debug("could not set the retry-after trailing metadata", exc_info=True)


def _problem(error: DecodeError) -> str:
    if "UTF-8" in str(error):
        return "a string field is not valid UTF-8"
    return "the bytes are not a valid protobuf encoding of it"
