"""Prompt hashing errors and salts (equality with the engine is in test_engine_integration.py)."""

from __future__ import annotations

import pytest
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.router import PromptHasher


def test_hashes_cover_full_blocks_and_the_salt_changes_them_all():
    hasher = PromptHasher(4)
    tokens = list(range(11))
    assert hasher.block_hashes(tokens) == hash_request_tokens(tokens, 4)
    assert len(hasher.block_hashes(tokens)) == 2
    salted = hasher.block_hashes(tokens, cache_salt="tenant")
    assert not set(salted) & set(hasher.block_hashes(tokens))


def test_token_ids_pass_through_and_text_needs_a_tokenizer():
    hasher = PromptHasher(4)
    assert hasher.token_ids((1, 2, 3)) == [1, 2, 3]
    with pytest.raises(ValueError, match="no tokenizer"):
        hasher.token_ids("hello")
    with pytest.raises(ValueError, match="block_size"):
        PromptHasher(0)


def test_an_empty_text_prompt_is_refused(llama_dir):
    with pytest.raises(ValueError, match="empty"):
        PromptHasher.from_model(llama_dir, 4).token_ids("")
