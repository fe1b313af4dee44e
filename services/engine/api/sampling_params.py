"""Per-request generation settings, validated when constructed.

Field names and defaults follow vLLM's `SamplingParams`, so code written against vLLM reads
the same here. `validate_for_model` adds the checks that need the model (vocabulary size).

best_of > n: best_of samples are generated and the n with the highest cumulative logprob
(the raw logprobs `logprobs` reports, summed) are returned, best first, once all are done:
nothing streams before the end. prompt_logprobs: computed during prefill from logits at
every prompt position; such a request does not read the prefix cache (cached tokens have
no logits), as in vLLM, though the blocks it fills are cached for others.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ..errors import InvalidRequestError

# OpenAI's bounds for a logit bias value.
MAX_LOGIT_BIAS = 100.0
# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# Checked finite before their ranges: NaN fails every comparison (the range message would
# mislead) and inf passes `temperature >= 0`.
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
)


class StructuredOutputKind(enum.StrEnum):
    JSON = "json"  # a JSON schema (spec: the schema as a JSON string)
    JSON_OBJECT = "json_object"  # any JSON object (no spec)
    REGEX = "regex"  # spec: the pattern the whole output matches
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: an EBNF/GBNF grammar with a `root` rule


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """What the output must match; compiled by the engine (engine/structured_output)."""

    kind: StructuredOutputKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    # JSON kinds: allow free whitespace between tokens. Off by default: small models fill
    # JSON with whitespace until max_tokens when they may.
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        field_name = self.field_name
        if self.kind is StructuredOutputKind.CHOICE:
            _check(bool(self.choices), field_name, "needs at least one choice")
            _check(all(isinstance(c, str) and c for c in self.choices), field_name, "choices must be non-empty strings")
            _check(not self.spec, field_name, "takes choices, not a spec")
        elif self.kind is StructuredOutputKind.JSON_OBJECT:
            _check(not self.spec and not self.choices, field_name, "takes no schema (use json for a schema)")
        else:
            _check(bool(self.spec and self.spec.strip()), field_name, "must not be empty")
            _check(not self.choices, field_name, "takes a spec, not choices")

    @property
    def field_name(self) -> str:
        """How errors name this constraint (the API field it came from maps onto it)."""
        return f"structured_output.{self.kind.value}"


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens and text so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # a single output when the request finishes


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # independent samples of one prompt; they share the prompt's KV blocks
    max_tokens: int | None = 16  # None: up to the model's context limit
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many are generated
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 disables
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    seed: int | None = None  # per-request generator: reproducible inside any batch
    presence_penalty: float = 0.0  # OpenAI-style, on generated tokens
    frequency_penalty: float = 0.0  # OpenAI-style, on generated tokens
    repetition_penalty: float = 1.0  # HF/CTRL-style, on prompt and generated tokens
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per token (the sampled token always included)
    allowed_token_ids: list[int] | None = None  # restrict sampling to these tokens
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0  # beam score = cumulative logprob / length ** length_penalty
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_output: StructuredOutputParams | None = None  # constrain the output (JSON, regex, ...)
    # token id -> value added to its logit before any other transform (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # top-N logprobs of every prompt token after the first (0: the prompt token's own only)
    prompt_logprobs: int | None = None
    best_of: int | None = None  # samples generated, >= n; the n best by cumulative logprob are returned

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(math.isfinite(value), name, f"must be a finite number, got {value}")
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k == -1 or self.top_k >= 1,
            "top_k",
            f"must be -1 (disabled) or >= 1, got {self.top_k}",
        )
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", f"must be >= 0, got {self.logprobs}")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty")
        if self.use_beam_search:
            _check(self.beam_width >= 1, "beam_width", f"must be >= 1, got {self.beam_width}")
            _check(self.n == 1, "n", "beam search returns beam_width beams; n must be 1")
            _check(self.max_tokens is not None, "max_tokens", "beam search needs max_tokens")
        if self.seed is not None:
            _check(0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        self._check_extensions()
        if self.structured_output is not None:
            _check(
                not self.use_beam_search,
                "use_beam_search",
                "beam search cannot be combined with structured output (beams would each need a grammar state)",
            )

    def _check_extensions(self) -> None:
        """logit_bias, prompt_logprobs and best_of (the ranges that need no model)."""
        if self.logit_bias:
            for token_id, value in self.logit_bias.items():
                _check(
                    isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0,
                    "logit_bias",
                    f"keys must be token ids (integers >= 0), got {token_id!r}",
                )
                _check(
                    isinstance(value, int | float) and math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS,
                    "logit_bias",
                    f"the bias of token {token_id} must be a finite number in [-100, 100], got {value!r}",
                )
            _check(
                not self.use_beam_search,
                "logit_bias",
                "cannot be combined with beam search (beams rank raw logprobs, which the bias does not change)",
            )
        if self.prompt_logprobs is not None:
            _check(self.prompt_logprobs >= 0, "prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
            _check(not self.use_beam_search, "prompt_logprobs", "cannot be combined with beam search")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
            _check(
                not self.use_beam_search or self.best_of == self.n,
                "best_of",
                "beam search returns beam_width beams; best_of must be unset or equal n",
            )

    @property
    def num_samples(self) -> int:
        """Samples generated: best_of when set (the best n are returned), else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_logprobs(self) -> bool:
        """Whether each sampled token's logprob is computed: asked for, or best_of ranks by it."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate_for_model(self, vocab_size: int, max_logprobs: int, max_num_seqs: int) -> None:
        """Checks that need the engine: vocabulary bounds, the logprobs limit, and samples per
        request (n, best_of, beam_width) within the sequences one step runs: each sample is a
        sequence, and a request of billions of them would stall the engine building them."""
        for name, value in (("n", self.n), ("best_of", self.best_of), ("beam_width", self.beam_width)):
            if value is not None:
                _check(
                    value <= max_num_seqs,
                    name,
                    f"must be <= {max_num_seqs} (the engine's max_num_seqs: each sample is a sequence), got {value}",
                )
        if self.logprobs is not None:
            _check(
                self.logprobs <= max_logprobs,
                "logprobs",
                f"must be <= {max_logprobs} (the engine's max_logprobs), got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            _check(
                self.prompt_logprobs <= max_logprobs,
                "prompt_logprobs",
                f"must be <= {max_logprobs} (the engine's max_logprobs), got {self.prompt_logprobs}",
            )
        if self.logit_bias:
            bad = sorted(t for t in self.logit_bias if t >= vocab_size)
            _check(not bad, "logit_bias", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if self.use_beam_search:
            _check(
                2 * self.beam_width <= vocab_size,
                "beam_width",
                f"must be <= half the vocabulary ({vocab_size // 2}), got {self.beam_width}",
            )
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, name, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(name, message)
