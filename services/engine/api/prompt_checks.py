"""The checks every prompt passes, wherever it enters (the engine's input processor, the
gateway before it places a request): one owner, so both answer with the same message.

The context rule is vLLM's: a request whose prompt plus `max_tokens` exceeds the context
limit is refused with both numbers, never cut short silently; without `max_tokens` it may
generate up to the end of the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidRequestError


def check_prompt_text(prompt: str, field: str = "prompt") -> None:
    if not prompt:
        raise InvalidRequestError(field, "must not be empty")
    check_unicode(prompt, field)


def check_unicode(text: str, field: str) -> None:
    """Refuses a lone surrogate (JSON's "\\ud800"): Python strings can hold one, UTF-8 cannot,
    so no tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code_point = ord(text[error.start])
        raise InvalidRequestError(
            field, f"contains a lone surrogate (U+{code_point:04X} at index {error.start}), which is not valid Unicode"
        ) from None


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int, max_model_len: int, field: str = "prompt") -> None:
    """Not empty, every id in the vocabulary, and room for at least one generated token."""
    if not prompt_ids:
        raise InvalidRequestError(field, "must not be empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            field,
            f"the prompt has {len(prompt_ids)} tokens but the context limit is {max_model_len} "
            "(prompt + at least one generated token)",
        )


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """How many tokens the request may generate: `max_tokens` if prompt + max_tokens fits the
    context (refused otherwise), the rest of the context when it is None."""
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequestError(
            "max_tokens",
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{num_prompt_tokens + max_tokens} tokens, over the context limit of {max_model_len}; "
            f"at most {room} fit after this prompt",
        )
    return max_tokens
