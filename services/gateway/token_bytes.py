"""A token's own bytes, for chat logprobs' `bytes` field (OpenAI: the UTF-8 bytes of the
token, which may be part of a character).

Decoding a token alone turns a partial UTF-8 sequence into U+FFFD, whose bytes are not the
token's. The vocabulary entry says what the bytes are:

  byte-level BPE (GPT-2, Llama 3, Qwen)   each character of the entry stands for one byte
                                          (GPT-2's byte-to-unicode table)
  SentencePiece byte fallback (Llama 2)   "<0xE2>" is the byte 0xE2; "▁" is a space
  anything else, special tokens           the UTF-8 of the decoded text
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the
    others to code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in decoders)


class TokenBytes:
    """token id -> its bytes, for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.is_byte_level = _is_byte_level(tokenizer)
        self.special_ids = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return list(cached)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None or token_id in self.special_ids:
            return list(self.tokenizer.decode([token_id]).encode())
        if self.is_byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
            return list(piece.encode())  # an added token written as plain text
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return [int(match.group(1), 16)]
        if "▁" in piece:  # SentencePiece's word boundary, which decoding alone may strip
            return list(piece.replace("▁", " ").encode())
        return list(self.tokenizer.decode([token_id]).encode())
