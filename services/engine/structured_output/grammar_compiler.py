"""Compiles what a request's output must match into an xgrammar `CompiledGrammar`.

Compilation runs on a small thread pool so the engine loop never waits for it; a request
is queued for scheduling only once its grammar is ready (engine_core.py). Identical specs
share one compilation: futures are cached by (kind, spec, choices, whitespace), bounded, the
oldest dropped first. A spec the compiler refuses fails its request with
InvalidRequestError naming the field and the compiler's reason.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..api.sampling_params import StructuredOutputKind, StructuredOutputParams
from ..config import StructuredOutputConfig
from ..errors import InvalidRequestError
from .json_schema_check import UnenforceableSchema, prepare_json_schema

# Compact JSON: no free whitespace, so small models cannot pad the output until max_tokens.
_COMPACT_SEPARATORS = (",", ":")
_LENIENT_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarCompiler:
    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], config: StructuredOutputConfig
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler = None  # built on first use: importing xgrammar costs about a second
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.num_compile_threads, thread_name_prefix="baton-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_lock = threading.Lock()

    def submit(self, params: StructuredOutputParams) -> Future:
        """A future of the compiled grammar; its exception is an InvalidRequestError."""
        key = (params.kind, params.spec, params.choices, params.any_whitespace)
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():  # a cached failure stays: the spec is bad
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            if self.config.grammar_cache_size:
                self._cache[key] = future
                while len(self._cache) > self.config.grammar_cache_size:
                    self._cache.popitem(last=False)
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals --------------------------------------------------------------------

    def _compile(self, params: StructuredOutputParams):
        compiler = self._xgrammar_compiler()
        kind = params.kind
        try:
            if kind in (StructuredOutputKind.JSON, StructuredOutputKind.JSON_OBJECT):
                schema = _enforceable_schema(params) if kind is StructuredOutputKind.JSON else '{"type": "object"}'
                return compiler.compile_grammar(self._json_grammar(schema, params.any_whitespace))
            if kind is StructuredOutputKind.REGEX:
                return compiler.compile_regex(params.spec)
            if kind is StructuredOutputKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(params.choices))
            return compiler.compile_grammar(params.spec)
        except InvalidRequestError:
            raise
        except UnenforceableSchema as error:
            raise InvalidRequestError(params.field_name, str(error)) from None
        except Exception as error:  # the compiler's own types; its message says what is wrong
            raise InvalidRequestError(params.field_name, f"cannot be compiled: {_reason(error)}") from None

    @staticmethod
    def _json_grammar(schema: str, any_whitespace: bool) -> str:
        """The schema's grammar as EBNF text. xgrammar 0.2.8 lets raw control characters
        into strings with a length bound ([^"\\\r\n]), which JSON forbids; the EBNF closes that."""
        import xgrammar

        options: dict[str, Any] = (
            {"any_whitespace": True}
            if any_whitespace
            else {
                "any_whitespace": False,
                "separators": _COMPACT_SEPARATORS,
            }
        )
        ebnf = str(xgrammar.Grammar.from_json_schema(schema, **options))
        return ebnf.replace(_LENIENT_STRING_CHAR, _JSON_STRING_CHAR)

    def _xgrammar_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos_token_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.config.num_compile_threads)
            return self._compiler


def _enforceable_schema(params: StructuredOutputParams) -> str:
    try:
        schema = json.loads(params.spec)
    except json.JSONDecodeError as error:
        raise InvalidRequestError(params.field_name, f"is not valid JSON: {error}") from None
    return json.dumps(prepare_json_schema(schema))


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _reason(error: Exception) -> str:
    """The compiler's message without its log prefix ("[hh:mm:ss] file.cc:83: ")."""
    text = _LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__
    return text if len(text) <= 500 else text[:500] + "..."
