"""Conversions between `baton.v1` protobuf messages and the generation service."""

from __future__ import annotations

from baton.v1 import inference_pb2 as pb

from ..engine.api.sampling_params import SamplingParams, StructuredOutputKind
from ..engine.errors import InvalidRequestError
from ..serving_errors import MalformedRequestError
from ..worker_calls import WorkerModelInfo
from .generation import GenerationEvent, GenerationRequest
from .grpc_servicers import MalformedMessage
from .request_limits import check_message_size
from .structured_output import Constraint, constraint_of_kind, json_schema_constraint

# Proto field -> SamplingParams field, for the optional scalars (unset means the default).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
    "best_of",
)


def parsed(request, max_bytes: int | None = None):
    """The request, or INVALID_ARGUMENT for bytes the proxy could not parse (grpc_servicers),
    or RESOURCE_EXHAUSTED for a message over `max_bytes` (its encoded size)."""
    if isinstance(request, MalformedMessage):
        raise MalformedRequestError(request.message)
    if max_bytes is not None:
        check_message_size(request.ByteSize(), max_bytes, f"{request.DESCRIPTOR.full_name} message")
    return request


def served_services() -> frozenset[str]:
    """The names the health check knows: the server as a whole ("") and each service."""
    from grpc_health.v1 import health_pb2

    services = (pb.DESCRIPTOR.services_by_name["Inference"], health_pb2.DESCRIPTOR.services_by_name["Health"])
    return frozenset({""} | {service.full_name for service in services})


def generation_request(request: pb.GenerateRequest) -> GenerationRequest:
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidRequestError("prompt", "set either text or token_ids")
    prompt = request.text if which == "text" else list(request.token_ids.ids)
    constraint = structured_output(request.sampling)
    return GenerationRequest(
        prompt=prompt,
        params=sampling_params(request.sampling, constraint),
        request_id=request.request_id,
        cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
        constraint_field=constraint.field if constraint else None,
    )


def structured_output(message: pb.SamplingParameters) -> Constraint | None:
    """The `structured_output` oneof; errors name its proto field (json_schema, regex, ...)."""
    which = message.WhichOneof("structured_output")
    any_whitespace = message.any_whitespace if message.HasField("any_whitespace") else False
    if which is None:
        return None
    if which == "json_schema":
        return json_schema_constraint(which, message.json_schema, any_whitespace)
    if which == "json_object":
        if not message.json_object:
            raise InvalidRequestError(which, "must be true when set; leave structured_output unset for free text")
        return constraint_of_kind(which, StructuredOutputKind.JSON_OBJECT, any_whitespace=any_whitespace)
    if which == "choice":
        return constraint_of_kind(which, StructuredOutputKind.CHOICE, choices=tuple(message.choice.choices))
    kind = StructuredOutputKind.REGEX if which == "regex" else StructuredOutputKind.GRAMMAR
    return constraint_of_kind(which, kind, spec=getattr(message, which))


def sampling_params(message: pb.SamplingParameters, constraint: Constraint | None = None) -> SamplingParams:
    kwargs = {name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)}
    if "seed" in kwargs and kwargs["seed"] >= 2**63:
        raise InvalidRequestError("seed", f"must be < 2**63, got {kwargs['seed']}")
    # float32 on the wire: round so that 0.9 arrives as 0.9, not 0.899999976.
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in kwargs:
            kwargs[name] = round(kwargs[name], 6)
    if message.logit_bias:
        kwargs["logit_bias"] = {token_id: round(bias, 6) for token_id, bias in message.logit_bias.items()}
    return SamplingParams(
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        structured_output=constraint.params if constraint else None,
        **kwargs,
    )


def generate_response(
    event: GenerationEvent, num_top_logprobs: int, prompt_token_ids: list[int], num_top_prompt_logprobs: int = 0
) -> pb.GenerateResponse:
    completion = event.completion
    response = pb.GenerateResponse(
        request_id=event.request_id,
        index=completion.index,
        token_ids=completion.token_ids,
        text=completion.text,
        finish_reason=completion.finish_reason or "",
    )
    if isinstance(completion.stop_reason, int):
        response.stop_token_id = completion.stop_reason
    elif isinstance(completion.stop_reason, str):
        response.stop_string = completion.stop_reason
    for token_id, entries in zip(completion.token_ids, completion.logprobs or []):
        response.logprobs.append(_token_logprob(token_id, entries, num_top_logprobs))
    for token_id, entries in zip(prompt_token_ids, event.prompt_logprobs or []):
        if entries is not None:  # the first prompt token's: nothing precedes it
            response.prompt_logprobs.append(_token_logprob(token_id, entries, num_top_prompt_logprobs))
    if event.finished:
        usage = event.usage
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
            )
        )
        trace = event.trace
        response.weight_version = trace.weight_version or ""
        response.timings.CopyFrom(
            pb.Timings(
                time_to_first_token_s=event.time_to_first_token_s or 0.0,
                total_s=event.total_s,
                kv_path=trace.kv_path,
                prefill_worker=trace.prefill_worker,
                decode_worker=trace.decode_worker,
            )
        )
    return response


def _token_logprob(token_id: int, entries: dict, num_top: int) -> pb.TokenLogprob:
    chosen = entries[token_id]
    ranked = sorted(entries.items(), key=lambda item: item[1].rank)[:num_top]
    top = [pb.TopLogprob(token_id=t, logprob=e.logprob, token=e.decoded_token or "") for t, e in ranked]
    return pb.TokenLogprob(token_id=token_id, logprob=chosen.logprob, rank=chosen.rank, top_logprobs=top)


def model_info(info: WorkerModelInfo, roles: list[str], mode: str, router: str) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        max_context_length=info.max_model_len,
        block_size=info.block_size,
        tensor_parallel_size=info.tensor_parallel_size,
        roles=roles,
        vocab_size=info.vocab_size,
        mode=mode,
        router=router,
    )
