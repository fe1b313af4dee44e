"""The block-hash contract: hash_request_tokens equals the documented encoding, chained block
by block by an independent reference here."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from baton.services.engine.core import block_hash
from baton.services.engine.core.block_hash import BLOCK_HASH_SEED, hash_request_tokens, request_extra_keys

CHAINS = {"python": block_hash._chain, "c": block_hash._native_chain}


def chained(tokens, block_size, extra_keys=()):
    """sha256(parent digest | uint32 length | uint32 tokens | first block: tagged extra keys)[:16]."""
    extra = b"".join(
        b"s" + struct.pack("<I", len(k.encode())) + k.encode() for k in extra_keys
    )  # request_extra_keys gives strings
    hashes, parent = [], hashlib.sha256(BLOCK_HASH_SEED).digest()[:16]
    for begin in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[begin : begin + block_size]
        data = parent + struct.pack(f"<I{block_size}I", block_size, *block) + (extra if begin == 0 else b"")
        parent = hashlib.sha256(data).digest()[:16]
        hashes.append(parent)
    return hashes


@pytest.fixture(params=list(CHAINS))
def chain(request, monkeypatch):
    """hash_request_tokens with each implementation of the chain: the C one and Python's."""
    monkeypatch.setattr(block_hash, "_native_chain", CHAINS[request.param])
    return request.param


def test_the_c_chain_is_built():
    """`pip install -e .` builds it (setup.py); without it hashing a prompt costs three times as much."""
    assert CHAINS["c"] is not None, (
        "baton.services.engine.core._block_hash is not built: it needs a C compiler and OpenSSL headers"
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_whole_prompt_hashes_equal_block_by_block_chaining(chain, block_size, salt):
    rng = random.Random(block_size)
    extra = request_extra_keys(salt)
    for length in [0, block_size - 1, block_size, 5 * block_size + 3, 64 * block_size]:
        tokens = [rng.randrange(2**32) for _ in range(length)]
        expected = chained(tokens, block_size, extra)
        assert hash_request_tokens(tokens, block_size, extra) == expected
        for resume in range(len(expected) + 1):  # continuing from hashes already computed
            assert hash_request_tokens(tokens, block_size, extra, start=expected[:resume]) == expected


@pytest.mark.parametrize(
    ("parent", "packed", "block_size", "message"),
    [
        (b"x" * 15, b"", 4, "parent hash must be 16 bytes"),
        (b"x" * 16, b"y" * 20, 4, "20 packed bytes are not whole blocks"),
        (b"x" * 16, b"", 0, "block_size must be"),
    ],
)
def test_the_c_chain_names_bad_arguments(parent, packed, block_size, message):
    with pytest.raises(ValueError, match=message):
        CHAINS["c"](parent, packed, block_size, b"")


def test_the_encoding_is_the_documented_one():
    root = hashlib.sha256(BLOCK_HASH_SEED).digest()[:16]
    first = hashlib.sha256(root + struct.pack("<3I", 2, 7, 9)).digest()[:16]
    assert hash_request_tokens([7, 9, 11], 2) == [first]


def test_tokens_outside_uint32_are_refused():
    with pytest.raises(struct.error):
        hash_request_tokens([1, -1], 2)
