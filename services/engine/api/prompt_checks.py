"""The checks every prompt passes, wherever it enters (the engine's input processor, the
gateway before it places a request): one owner, so both answer with the same message."""

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
