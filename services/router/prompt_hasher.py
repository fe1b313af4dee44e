"""Turns a prompt into the block hashes the engine's prefix cache will register for it.

Both halves are the engine's own: its tokenizer loader and the one block-hash function
(services/engine/core/block_hash.py), with the cache salt entering the first block exactly as
`EngineCore` adds it. A test proves the hashes equal the ones a real engine publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine.api.input_processor import tokenize_prompt
from ..engine.core.block_hash import BlockHash, hash_request_tokens, request_extra_keys


class PromptHasher:
    def __init__(self, block_size: int, tokenizer: Any | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.tokenizer = tokenizer

    @classmethod
    def from_model(cls, model_dir: str | Path, block_size: int) -> PromptHasher:
        from ..engine.api.tokenizer import load_tokenizer  # transformers is heavy: only when asked for

        return cls(block_size, load_tokenizer(model_dir))

    def token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids as the engine computes them (text is encoded with special tokens)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("this PromptHasher has no tokenizer: pass token ids, or build it with from_model()")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return tokenize_prompt(self.tokenizer, prompt)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        return hash_request_tokens(token_ids, self.block_size, request_extra_keys(cache_salt))
