"""The context rule (`engine/api/prompt_checks.resolve_max_tokens`: prompt + max_tokens must
fit the context) checked at the gateway, before a request is placed: a refusal then costs no
worker a round trip and leaves no traceback in a worker's log. The engine applies the same
rule again for every caller, offline ones included."""

from __future__ import annotations

from ..engine.api.prompt_checks import resolve_max_tokens
from .generation import GenerationRequest, GenerationService, PreparedGeneration


async def prepare_within_context(service: GenerationService, request: GenerationRequest) -> PreparedGeneration:
    """`service.prepare(request)`, refusing a request whose max_tokens does not fit after its prompt."""
    prepared = await service.prepare(request)
    info = await service.model_info()
    call = prepared.call
    resolve_max_tokens(len(call.prompt_token_ids), call.params.max_tokens, info.max_model_len)
    return prepared
