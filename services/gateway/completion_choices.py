"""The choices of a /v1/completions response, whole or streamed, with `echo` and prompt
logprobs.

    echo                the prompt's text comes first: in the choice's text, or in the first
                        chunk a streamed choice sends
    echo + logprobs     the prompt's tokens lead the logprobs lists; the first has no logprob
                        (token_logprobs[0] and top_logprobs[0] are null, as OpenAI's)
    prompt_logprobs     vLLM's: each choice also carries `prompt_logprobs`, None for the first
                        prompt token, then {token id: {logprob, rank, decoded_token}}

text_offset: a completion token's is its place in the choice's text (echoed prompt
included); a prompt token's counts the characters of the prompt pieces before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.api.outputs import CompletionOutput, PromptLogprobs
from .generation import GenerationEvent
from .openai_protocol import completion_logprobs, openai_finish_reason


@dataclass(slots=True)
class EchoedPrompt:
    """One prompt of the request, as echo and prompt logprobs need it."""

    text: str | None  # echo: the prompt's text (a token prompt decoded); None: no echo
    token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None  # from the engine's first output


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> list[Any] | None:
    if prompt_logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            str(token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
            for token_id, e in entries.items()
        }
        for entries in prompt_logprobs
    ]


@dataclass(slots=True)
class CompletionChoices:
    prompts: list[EchoedPrompt]  # one per prompt; choice i belongs to prompt i // n
    n: int
    has_logprobs: bool
    wants_prompt_logprobs: bool
    return_token_ids: bool
    decode_piece: Callable[[int], str]  # one token's text (the first prompt token's piece)
    _offsets: dict[int, int] = field(default_factory=dict)  # streamed: text_offset so far, per choice

    @classmethod
    def build(cls, body: Any, prompts: list[str | list[int]], calls: list[Any], tokenizer: Any) -> CompletionChoices:
        """For a CompletionRequest `body`, its prompts and their GenerateCalls (same order)."""
        echoed = [
            EchoedPrompt(
                (p if isinstance(p, str) else tokenizer.decode(p)) if body.echo else None, list(call.prompt_token_ids)
            )
            for p, call in zip(prompts, calls)
        ]
        return cls(
            echoed,
            calls[0].params.n,
            has_logprobs=body.logprobs is not None,
            wants_prompt_logprobs=calls[0].params.prompt_logprobs is not None,
            return_token_ids=bool(body.return_token_ids),
            decode_piece=lambda token_id: tokenizer.decode([token_id]),
        )

    def note(self, request_index: int, event: GenerationEvent) -> None:
        """Keeps the prompt logprobs an event brought (the engine sends them once)."""
        if event.prompt_logprobs is not None:
            self.prompts[request_index].prompt_logprobs = event.prompt_logprobs

    def whole(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        """The choice of a non-streaming response."""
        return self._choice(index, completion, openai_finish_reason(completion.finish_reason), first=True)

    def streamed(self, request_index: int, event: GenerationEvent) -> dict[str, Any]:
        """A chunk's choice; the first of each choice carries the echoed prompt."""
        self.note(request_index, event)
        index = request_index * self.n + event.completion.index
        first = index not in self._offsets
        finish = openai_finish_reason(event.completion.finish_reason)
        return self._choice(index, event.completion, finish, first)

    def _choice(self, index: int, completion: CompletionOutput, finish: str | None, first: bool) -> dict[str, Any]:
        prompt = self.prompts[index // self.n]
        echo = first and prompt.text is not None
        offset = self._offsets.get(index, 0)
        logprobs = None
        if self.has_logprobs:
            head = self._prompt_part(prompt) if echo else None
            completion_offset = offset + (len(prompt.text) if echo else 0)
            logprobs = _joined(head, completion_logprobs(completion, completion_offset))
        text = (prompt.text if echo else "") + completion.text
        self._offsets[index] = offset + len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.wants_prompt_logprobs and first:
            choice["prompt_logprobs"] = prompt_logprobs_body(prompt.prompt_logprobs)
        if self.return_token_ids:
            choice["token_ids"] = list(completion.token_ids)
        return choice

    def _prompt_part(self, prompt: EchoedPrompt) -> dict[str, list]:
        """The logprobs lists of the prompt's tokens (the first without a logprob)."""
        entries = prompt.prompt_logprobs or [None]
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for position, token_id in enumerate(prompt.token_ids):
            ranked = entries[position] if position < len(entries) else None
            chosen = ranked.get(token_id) if ranked else None
            piece = chosen.decoded_token if chosen is not None else self.decode_piece(token_id)
            tokens.append(piece or "")
            token_logprobs.append(None if chosen is None else chosen.logprob)
            top.append(None if ranked is None else {e.decoded_token or "": e.logprob for e in _by_rank(ranked)})
            offsets.append(offset)
            offset += len(piece or "")
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _by_rank(entries: dict) -> list:
    return sorted(entries.values(), key=lambda e: e.rank)


def _joined(head: dict[str, list] | None, tail: dict[str, list] | None) -> dict[str, list] | None:
    if head is None:
        return tail
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in head}
