"""The generation service behind both APIs: tokenize once, validate, place, stream.

    GenerationRequest (from gRPC or OpenAI)
      -> prompt text bound (request_limits: characters, before any tokenizing)
      -> prompt token ids (the gateway's tokenizer; chat template for chat requests), on the
         tokenizer thread pool, never on the event loop
      -> checks: sampling parameters, prompt length against the context limit
      -> EngineClient.stream(GenerateCall)  ->  RequestOutput deltas  ->  GenerationEvent

Every request has an id (the client's, or a fresh uuid4, unguessable), so `abort` can reach
it, and an owner (the fingerprint of the API key that sent it, `api_keys.Caller`): only that
key or an admin key may abort it, and to any other caller it is as if no such request ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..engine.api.outputs import CompletionOutput, PromptLogprobs
from ..engine.api.prompt_checks import check_prompt_ids, check_prompt_text, resolve_max_tokens
from ..engine.api.sampling_params import RequestOutputKind, SamplingParams
from ..engine.errors import InvalidRequestError
from ..serving_errors import NotFoundError
from ..worker_calls import GenerateCall, WorkerModelInfo
from .api_keys import ANONYMOUS, Caller
from .engine_client import EngineClient, PlacementTrace
from .inflight_limit import InflightLimit
from .request_limits import RequestLimits, check_text_length, num_chars
from .structured_output import user_facing


@dataclass(slots=True)
class GenerationRequest:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str = ""
    cache_salt: str | None = None
    add_special_tokens: bool = True
    api: str = "grpc"  # which API it came through (a metrics label)
    constraint_field: str | None = None  # the API field params.structured_output came from
    owner: str | None = None  # the sending key's fingerprint (None: a gateway without keys)


@dataclass(slots=True)
class PreparedGeneration:
    call: GenerateCall  # what the workers receive
    arrival: float  # time.monotonic() when the gateway got the request
    api: str = "grpc"
    constraint_field: str | None = None  # names the constraint in the engine's compile errors
    owner: str | None = None  # who may abort it (with any admin key)


@dataclass(slots=True)
class _InFlight:
    aborted: asyncio.Event  # set when aborted
    owner: str | None  # the fingerprint of the key that created it


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class GenerationEvent:
    """One streamed piece: new tokens/text of one sample, and at the end usage and timings."""

    request_id: str
    completion: CompletionOutput  # a delta: only the new tokens and text of sample `index`
    usage: Usage
    finished: bool  # the whole request (all samples) is done
    time_to_first_token_s: float | None
    total_s: float
    trace: PlacementTrace
    # prompt_logprobs asked for: on the first event of the output that brought them
    prompt_logprobs: PromptLogprobs | None = None


class GenerationService:
    def __init__(
        self,
        tokenizer: Any,
        engine_client: EngineClient,
        on_finished: Callable[[str, GenerationEvent], None] | None = None,
        limits: RequestLimits | None = None,
        inflight: InflightLimit | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.engine_client = engine_client
        self.on_finished = on_finished  # metrics: (api, the request's last event)
        self.limits = limits if limits is not None else RequestLimits()
        # Both APIs take a slot per generation request (inflight_limit.py); over the bound: shed.
        self.inflight = inflight if inflight is not None else InflightLimit(self.limits.max_inflight_requests)
        # The Rust tokenizer releases the GIL while it works: these threads keep it off the loop.
        self._tokenizer_pool = ThreadPoolExecutor(self.limits.tokenizer_threads, thread_name_prefix="baton-tokenizer")
        self._model_info: WorkerModelInfo | None = None
        self._inflight: dict[str, _InFlight] = {}  # by request id

    async def model_info(self) -> WorkerModelInfo:
        if self._model_info is None:
            self._model_info = await self.engine_client.model_info()
        return self._model_info

    async def tokenize(self, text: str, add_special_tokens: bool = True, field: str = "text") -> list[int]:
        """`text`'s token ids, from the tokenizer pool; text that cannot fit the context is
        refused first, untokenized (request_limits)."""
        check_text_length(len(text), field, self.limits, (await self.model_info()).max_model_len)
        return await self._off_loop(self._encode, text, add_special_tokens)

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt's token ids; `tools` (OpenAI's function tools) reach the templates that
        describe tools to the model, and the others ignore them."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("messages", "the model has no chat template; use /v1/completions")
        if "developer" not in str(template):  # OpenAI's newer name for system instructions
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        max_model_len = (await self.model_info()).max_model_len
        check_text_length(num_chars(messages) + num_chars(tools), "messages", self.limits, max_model_len)
        try:
            text = await self._off_loop(
                self.tokenizer.apply_chat_template, messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # the template raised on these messages
            raise InvalidRequestError("messages", f"the chat template rejected the messages: {e}") from e
        # As apply_chat_template(tokenize=True) does: the template writes the special tokens.
        return await self._off_loop(self._encode, text, False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The tokenizer's `encode`; for a fast tokenizer, its Rust backend without offsets,
        which holds the GIL only to build the id list (transformers' wrapper builds more)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch_fast"):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    async def _off_loop(self, function: Callable, *args, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, functools.partial(function, *args, **kwargs))

    def abort(self, request_id: str, caller: Caller = ANONYMOUS) -> bool:
        """Whether a running request had that id and `caller` may abort it; another key's
        request answers False, as an unknown id does, so ids cannot be probed."""
        inflight = self._inflight.get(request_id)
        if inflight is None or not caller.may_act_on(inflight.owner):
            return False
        inflight.aborted.set()
        return True

    async def check_model(self, name: str | None) -> None:
        info = await self.model_info()
        if name and name != info.model:
            raise NotFoundError(f"the model {name!r} does not exist; this server serves {info.model!r}")

    async def prepare(self, request: GenerationRequest) -> PreparedGeneration:
        """Tokenizes and validates: every InvalidRequestError surfaces here, before streaming."""
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._inflight:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt_ids = await self._prompt_ids(request)
        params = dataclasses.replace(request.params, output_kind=RequestOutputKind.DELTA)
        call = GenerateCall(request_id, prompt_ids, params, request.cache_salt)
        return PreparedGeneration(call, time.monotonic(), request.api, request.constraint_field, request.owner)

    async def stream(self, prepared: PreparedGeneration) -> AsyncIterator[GenerationEvent]:
        call, arrival = prepared.call, prepared.arrival
        request_id, params = call.request_id, call.params
        trace = PlacementTrace()
        usage = Usage(prompt_tokens=len(call.prompt_token_ids))
        first_token: float | None = None
        aborted = asyncio.Event()
        self._inflight[request_id] = _InFlight(aborted, prepared.owner)
        stream = self.engine_client.stream(call, trace)
        try:
            while True:
                output = await _next_or_abort(stream, aborted)
                if output is None:  # aborted by id: close downstream, report "abort"
                    for index in range(_num_samples(params)):
                        yield self._event(
                            request_id, _aborted_completion(index), usage, True, first_token, arrival, trace
                        )
                    return
                usage.cached_tokens = output.num_cached_tokens
                trace.weight_version = output.weight_version or trace.weight_version
                for completion in output.outputs:
                    usage.completion_tokens += len(completion.token_ids)
                    if first_token is None and completion.token_ids:
                        first_token = time.monotonic()
                last = len(output.outputs) - 1
                for i, completion in enumerate(output.outputs):
                    event = self._event(
                        request_id, completion, usage, output.finished and i == last, first_token, arrival, trace
                    )
                    if i == 0:
                        event.prompt_logprobs = output.prompt_logprobs
                    if event.finished and self.on_finished is not None:
                        self.on_finished(prepared.api, event)
                    yield event
                if output.finished:
                    return
        except Exception as error:
            renamed = user_facing(error, prepared.constraint_field)
            if renamed is error:
                raise
            raise renamed from error
        finally:
            self._inflight.pop(request_id, None)
            # A stream still running is the one whose __anext__ was cancelled with this
            # caller (_next_or_abort): it closes itself as that cancel unwinds it.
            if not getattr(stream, "ag_running", False):
                await stream.aclose()

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        info = await self.model_info()
        if isinstance(request.prompt, str):
            check_text_length(len(request.prompt), "prompt", self.limits, info.max_model_len)  # before it is read
            check_prompt_text(request.prompt)
            prompt_ids = await self.tokenize(request.prompt, request.add_special_tokens, field="prompt")
        else:
            prompt_ids = list(request.prompt)
        check_prompt_ids(prompt_ids, info.vocab_size, info.max_model_len)
        # The context rule, before placing: a refusal costs no worker a round trip (the
        # engine applies it again for every caller, offline ones included).
        resolve_max_tokens(len(prompt_ids), request.params.max_tokens, info.max_model_len)
        return prompt_ids

    @staticmethod
    def _event(request_id, completion, usage, finished, first_token, arrival, trace) -> GenerationEvent:
        now = time.monotonic()
        return GenerationEvent(
            request_id,
            completion,
            dataclasses.replace(usage),
            finished,
            None if first_token is None else first_token - arrival,
            now - arrival,
            trace,
        )


async def _next_or_abort(stream: AsyncIterator, aborted: asyncio.Event):
    """The stream's next item, or None once `aborted` is set (whichever comes first)."""
    next_item = asyncio.ensure_future(stream.__anext__())
    abort_wait = asyncio.ensure_future(aborted.wait())
    try:
        done, _ = await asyncio.wait({next_item, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client left: the pending __anext__ goes too (it cancels downstream)
        next_item.cancel()
        raise
    finally:
        abort_wait.cancel()
    if next_item in done:
        return next_item.result()
    next_item.cancel()
    await asyncio.gather(next_item, return_exceptions=True)  # let the generator unwind before aclose()
    return None


def _num_samples(params: SamplingParams) -> int:
    return params.beam_width if params.use_beam_search else params.n


def _aborted_completion(index: int) -> CompletionOutput:
    return CompletionOutput(index, "", [], None, None, "abort")
