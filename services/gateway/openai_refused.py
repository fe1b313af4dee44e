"""OpenAI and vLLM request fields that Baton does not implement and that would change the
output: a request that sets one gets a 400 naming it, never a 200 that ignored it.

Each field is refused only when its value asks for something: `echo: false` or
`modalities: ["text"]` change nothing and pass. Fields that do not change
the output are accepted and ignored: `user`, `metadata`, `store`, `service_tier`,
`safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`, `prediction` (a
latency hint: the output is the same), `parallel_tool_calls: true`, `priority`,
`guided_decoding_backend`, `kv_transfer_params`; so are fields neither API knows.
`best_of` (not with `stream`) and `top_logprobs` (only with `logprobs`) are checked by the
request shapes, which know `stream` and `logprobs`. `logit_bias` (both APIs), `echo` and
`prompt_logprobs` (completions) are implemented, so not listed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Refusal:
    changes_nothing: Callable[[Any], bool]  # the values that ask for nothing and pass
    reason: str


def _empty(value: Any) -> bool:
    return not value


def _unset(value: Any) -> bool:
    return value is None


def _true_or_unset(value: Any) -> bool:
    return value is None or value is True


_BOTH = {
    "use_beam_search": Refusal(_empty, "beam search is not supported over the OpenAI API"),
    "bad_words": Refusal(_empty, "bad words are not supported"),
    "logits_processors": Refusal(_empty, "custom logits processors are not supported"),
    "truncate_prompt_tokens": Refusal(_unset, "prompt truncation is not supported; shorten the prompt"),
    "return_tokens_as_token_ids": Refusal(_empty, "is not supported: tokens are returned as text"),
    "spaces_between_special_tokens": Refusal(
        _true_or_unset, "false is not supported: special tokens are detokenized with spaces"
    ),
    "guided_whitespace_pattern": Refusal(_unset, "a whitespace pattern is not supported; see any_whitespace"),
}

COMPLETION_REFUSALS = {
    **_BOTH,
    "suffix": Refusal(_empty, "a suffix (insertion) is not supported"),
    "prompt_embeds": Refusal(_unset, "prompt embeddings are not supported; send text or token ids"),
}

CHAT_REFUSALS = {
    **_BOTH,
    "functions": Refusal(_empty, "is deprecated by OpenAI and not supported; use tools and tool_choice"),
    "function_call": Refusal(_unset, "is deprecated by OpenAI and not supported; use tools and tool_choice"),
    "audio": Refusal(_unset, "audio output is not supported"),
    "modalities": Refusal(lambda v: v is None or v == ["text"], 'only ["text"] output is supported'),
    "reasoning_effort": Refusal(_unset, "reasoning controls are not supported"),
    "verbosity": Refusal(_unset, "verbosity controls are not supported"),
    "web_search_options": Refusal(_unset, "web search is not supported"),
    "prompt_logprobs": Refusal(_unset, "is supported on /v1/completions only (with echo or on its own)"),
    "echo": Refusal(_empty, "echoing the last message is not supported"),
    "add_generation_prompt": Refusal(_true_or_unset, "false is not supported: the assistant's turn is always started"),
    "continue_final_message": Refusal(_empty, "continuing the final message is not supported"),
    "add_special_tokens": Refusal(_empty, "true is not supported: the chat template adds the special tokens"),
    "chat_template": Refusal(_unset, "a custom chat template is not supported: the model's own is used"),
    "chat_template_kwargs": Refusal(_empty, "chat template arguments are not supported"),
    "documents": Refusal(_empty, "documents for the chat template are not supported"),
}


def refuse_unsupported(fields: dict[str, Any], refusals: dict[str, Refusal]) -> None:
    """Raises a 400 for the first field in `fields` whose value asks for something refused."""
    for name, value in fields.items():
        refusal = refusals.get(name)
        if refusal is not None and not refusal.changes_nothing(value):
            raise InvalidRequestError(name, refusal.reason)
