"""Turns what a caller sends into a validated, tokenized request (no engine state touched,
so it runs on any thread: the async engine validates on the caller's event loop).

`tokenize_prompt` is the one way a text prompt becomes token ids; the router's hasher uses
it too, so the block hashes a router computes match the engine's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ...model.config import ModelArch
from ..config import EngineConfig
from ..errors import InvalidRequestError
from ..structured_output.grammar_compiler import GrammarCompiler
from .handover import Handover, can_disaggregate
from .prompt_checks import check_prompt_ids, check_prompt_text, resolve_max_tokens
from .sampling_params import SamplingParams


def tokenize_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a text prompt, with the special tokens the model's tokenizer adds."""
    return tokenizer.encode(prompt, add_special_tokens=True)


@dataclass(slots=True)
class PreparedRequest:
    """A tokenized, validated request, ready to be queued."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context limit (prompt_checks.resolve_max_tokens)
    seed: int | None
    cache_salt: str | None
    arrival_time: float
    handover: Handover | None = None  # disaggregation: which side of a P/D handover
    grammar: Future | None = None  # structured output: the grammar compiling for it
    grammar_deadline: float = 0.0  # time.monotonic() by which it must have compiled

    def compiled_grammar(self) -> Any:
        """The compiled grammar (None without structured output); raises InvalidRequestError
        if it failed. Call once the future is done."""
        return None if self.grammar is None else self.grammar.result()

    def grammar_timed_out(self, now: float) -> InvalidRequestError | None:
        if self.grammar is None or self.grammar.done() or now < self.grammar_deadline:
            return None
        return self._timeout_error()

    def wait_for_grammar(self) -> None:
        """Blocks until the grammar compiled (offline callers); raises InvalidRequestError."""
        if self.grammar is None:
            return
        try:
            self.grammar.result(timeout=max(0.0, self.grammar_deadline - time.monotonic()))
        except TimeoutError:
            raise self._timeout_error() from None

    def _timeout_error(self) -> InvalidRequestError:
        return InvalidRequestError(
            self.params.structured_output.field_name,
            "did not compile in time (structured_output.compile_timeout_s); simplify it or raise the limit",
        )

    @property
    def output_prefix(self) -> tuple[int, ...]:
        """Tokens already generated elsewhere (decode side: the prefill worker's)."""
        return self.handover.first_token_ids if self.handover is not None else ()


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        tokenizer: Any,
        max_model_len: int,
        grammars: GrammarCompiler,
    ) -> None:
        self.config = config
        self.arch = arch
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.grammars = grammars

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        handover: Handover | None = None,
    ) -> PreparedRequest:
        """Tokenizes and validates; raises InvalidRequestError naming the field.

        `handover` (engine/api/handover.py): the prefill side runs the prompt and the first
        token, the decode side continues a request whose prompt was prefilled elsewhere.
        """
        params = params or SamplingParams()
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._validate(prompt_ids, params)
        max_tokens = resolve_max_tokens(len(prompt_ids), params.max_tokens, self.max_model_len)
        if handover is not None:
            self._validate_handover(prompt_ids, params, handover)
        now = time.monotonic()
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.submit(params.structured_output)  # compiles beside the engine loop
        return PreparedRequest(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
            seed=params.seed,
            cache_salt=cache_salt,
            arrival_time=arrival_time if arrival_time is not None else now,
            handover=handover,
            grammar=grammar,
            grammar_deadline=now + self.config.structured_output.compile_timeout_s,
        )

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            ids, field = tokenize_prompt(self.tokenizer, prompt), "prompt"
        else:
            ids, field = list(prompt), "prompt_token_ids"
        check_prompt_ids(ids, self.arch.vocab_size, self.max_model_len, field)
        return (prompt if isinstance(prompt, str) else None), ids

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate_for_model(
            self.arch.vocab_size, self.config.model.max_logprobs, self.config.scheduler.max_num_seqs
        )
        if (
            not self.config.scheduler.enable_chunked_prefill
            and len(prompt_ids) > self.config.scheduler.max_num_batched_tokens
        ):
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(prompt_ids)} tokens, more than max_num_batched_tokens "
                f"({self.config.scheduler.max_num_batched_tokens}) with chunked prefill off",
            )

    def _validate_handover(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        handover: Handover,
    ) -> None:
        output_prefix, remote_kv = handover.first_token_ids, handover.remote_kv
        if not can_disaggregate(params):
            raise InvalidRequestError("n", "a disaggregated request has one sample and no beam search")
        if len(prompt_ids) + len(output_prefix) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"prompt and generated tokens ({len(prompt_ids) + len(output_prefix)}) "
                f"reach the context limit ({self.max_model_len})",
            )
        if remote_kv is not None:
            if remote_kv.block_size != self.config.cache.block_size:
                raise InvalidRequestError(
                    "remote_kv", f"block size {remote_kv.block_size} != this engine's {self.config.cache.block_size}"
                )
            if remote_kv.num_tokens != len(prompt_ids):
                raise InvalidRequestError(
                    "remote_kv", f"covers {remote_kv.num_tokens} tokens, the prompt has {len(prompt_ids)}"
                )
            if remote_kv.tp_size != self.config.parallel.tensor_parallel_size:
                raise InvalidRequestError(
                    "remote_kv",
                    f"comes from {remote_kv.tp_size} TP ranks, this engine has "
                    f"{self.config.parallel.tensor_parallel_size}",
                )
