"""Incremental detokenization and stop strings.

Text is decoded over a short sliding window of token ids (seeded with the prompt's last
tokens, so tokenizers that drop a leading space decode the first output token right);
a delta is emitted only once it no longer ends in an incomplete UTF-8 character:

    ids:  ... p p p | o o o o
                ^prefix_offset  ^read_offset     delta = decode(ids[prefix:]) - decode(ids[prefix:read])

While stop strings are set, the last `max(len(stop)) - 1` characters are held back from
streaming, so a client never sees text that a stop string later cuts off.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.num_emitted_chars = 0
        self.stopped = False

    def append(self, token_id: int) -> str | None:
        """Adds one generated token; returns the stop string it completed, if any."""
        if self.stopped:
            return None
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # nothing printable yet (e.g. half of a multi-byte character)
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return self._check_stop(len(delta))

    def flush(self) -> None:
        """At the end: whatever is left in the window, even an incomplete character."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self.text += new_text[len(prefix_text) :]
        self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out (holding back a possible stop-string prefix)."""
        end = len(self.text) if finished or self.stopped else max(len(self.text) - self.hold_back, 0)
        end = max(end, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta

    def _check_stop(self, delta_len: int) -> str | None:
        for stop in self.stop:
            begin = max(0, len(self.text) - delta_len - len(stop) + 1)
            index = self.text.find(stop, begin)
            if index >= 0:
                self.text = self.text[: index + len(stop) if self.include_stop else index]
                self.stopped = True
                return stop
        return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
