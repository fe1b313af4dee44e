"""The one block-hash function. The engine's prefix cache and the router both use it.

A block's hash chains over its parent, so equal hashes mean equal whole prefixes:

    h0 = H(ROOT, tokens[0:B], extra_keys)       extra keys (e.g. a cache salt) enter once,
    h1 = H(h0,   tokens[B:2B])                   in the first block, and chain onwards
    h2 = H(h1,   tokens[2B:3B])                  only full blocks are hashed

H is SHA-256 over a fixed byte encoding (parent digest, little-endian uint32 token ids,
length-prefixed extra keys), truncated to 16 bytes. It is stable across processes, hosts
and Python versions (unlike `hash()`), and the seed below is part of the contract: change
it and every index built with the old one is void.

The chain runs in C (_block_hash.c, built by `pip install`) when that module is there, a
third of the time of the Python loop below, which stays the reference and the fallback.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence

BLOCK_HASH_SEED = b"baton/block-hash/v1"
BLOCK_HASH_BYTES = 16

BlockHash = bytes
ExtraKeys = tuple[str | int | bytes, ...]

ROOT_PARENT_HASH: BlockHash = hashlib.sha256(BLOCK_HASH_SEED).digest()[:BLOCK_HASH_BYTES]

try:
    from ._block_hash import chain as _native_chain
except ImportError:  # not built (no compiler or OpenSSL headers at install time)
    _native_chain = None
    logging.getLogger(__name__).warning(
        "baton.services.engine.core._block_hash is not built: prompts are hashed in Python, about three "
        "times slower (pip install Baton where a C compiler and OpenSSL's headers are present)"
    )


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys = (),
    start: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`; `start` holds hashes already computed."""
    hashes = list(start)
    begin, end = len(hashes) * block_size, len(token_ids) // block_size * block_size
    if begin >= end:
        return hashes
    extra = b"".join(_encode_key(key) for key in extra_keys) if begin == 0 else b""
    parent = hashes[-1] if hashes else ROOT_PARENT_HASH
    chain = _native_chain or _chain
    return hashes + chain(parent, _pack_tokens(token_ids[begin:end]), block_size, extra)


def request_extra_keys(cache_salt: str | None) -> ExtraKeys:
    """Extra keys of a request's first block: a cache salt isolates tenants' caches."""
    return ("salt", cache_salt) if cache_salt else ()


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _chain(parent: BlockHash, packed: bytes, block_size: int, extra: bytes) -> list[BlockHash]:
    """The hashes of consecutive full blocks of packed tokens. A block hashes its parent's
    digest, its length and its tokens (uint32 little-endian), and the first block the extra
    keys. Packing the tokens once halves the cost of hashing a prompt; copying an empty
    SHA-256 state costs half of making one (OpenSSL looks the digest up each time).
    _block_hash.chain computes the same."""
    length = struct.pack("<I", block_size)
    stride, empty, hashes = 4 * block_size, hashlib.sha256(), []
    for offset in range(0, len(packed), stride):
        state = empty.copy()
        state.update(parent + length + packed[offset : offset + stride] + extra)
        parent = state.digest()[:BLOCK_HASH_BYTES]
        hashes.append(parent)
        extra = b""
    return hashes


def _encode_key(key: str | int | bytes) -> bytes:
    if isinstance(key, bytes):
        tag, data = b"b", key
    elif isinstance(key, str):
        tag, data = b"s", key.encode()
    elif isinstance(key, int):
        tag, data = b"i", key.to_bytes(16, "little", signed=True)
    else:
        raise TypeError(f"block hash extra keys must be str, int or bytes, got {type(key)}")
    return tag + struct.pack("<I", len(data)) + data
