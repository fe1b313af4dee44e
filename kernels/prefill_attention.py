"""Varlen causal prefill attention over the paged KV cache, FlashAttention-style.

A request's query chunk is the last Q tokens of its L-token context; the chunk's own K/V
are already in the cache (reshape-and-cache runs first), so every key comes through the
block table. This serves plain prefill (Q = L), chunked prefill and prefix-cache hits alike.

One program serves one tile of BLOCK_M queries of one request and one query head:

    context    [ 0 ................................................ L )
    queries                               [ chunk: positions L-Q .. L-1 )
    this tile                                  [ first .. first+BLOCK_M )
    keys       [ unmasked: every query sees them )[ causal: masked )
               0                           first rounded down     min(L, first+BLOCK_M)
                                           to BLOCK_N

Scores are in log2 units (scale * log2(e) folded in) and accumulate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_tiles import LOG2_E, compute_capability, dot_precision, online_softmax_update, paged_row_offsets
from .checks import check_devices, check_int, check_paged_attention, check_power_of_two
from .interpreter import cast_to, dot_operand, is_interpreter


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Launch shape: BLOCK_M queries per program, BLOCK_N keys per step (powers of two >= 16,
    as tl.dot needs), and the compiler's warps and software-pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            check_power_of_two(name, getattr(self, name), 16, why=" (tl.dot)")

    @staticmethod
    def default(head_dim: int, element_size: int = 2, sm: int = 0) -> PrefillTiles:
        """The Q tile and the float32 accumulator stay in registers; K/V tiles are staged.

        `sm` is the GPU's compute capability as major * 10 + minor (0: unknown). Hopper's
        shared memory holds two stages of 128-key 16-bit tiles at head size 128, 10% faster
        there than 64-key tiles (`make gpu-check` on an H200, docs/benchmarks.md); Ampere's
        does not.
        """
        if head_dim <= 64:
            return PrefillTiles(128, 64, num_warps=4)
        if head_dim <= 128:
            if sm >= 90 and element_size == 2:
                return PrefillTiles(128, 128, num_warps=8, num_stages=2)
            return PrefillTiles(128, 64, num_warps=8)
        return PrefillTiles(64, 32, num_warps=8, num_stages=2)


@triton.jit
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Grid (query tiles of the longest chunk, requests, query heads)."""
    # Last tiles first: they see the most keys, so the launch does not end on a long one.
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + req)
    num_queries = tl.load(query_start_loc_ptr + req + 1) - q_begin
    if q_tile * BLOCK_M >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first = seq_len - num_queries + q_tile * BLOCK_M
    tile_rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    is_query = tile_rows < num_queries
    query_positions = seq_len - num_queries + tile_rows
    dims = tl.arange(0, HEAD_DIM)

    q_offsets = (q_begin + tile_rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=is_query[:, None], other=0.0)
    q = dot_operand(q, INTERPRETED)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row_ptr = block_tables_ptr + req * stride_table
    kv_head_offset = (head // GROUP) * stride_cache_head

    # Keys before `first` (rounded down to a tile) are visible to every query: no masks.
    unmasked_end = (first // BLOCK_N) * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        cache_rows = paged_row_offsets(
            block_table_row_ptr, tile_start, seq_len, stride_cache_block, stride_cache_slot, BLOCK_N, BLOCK_SIZE
        )
        offsets = cache_rows[:, None] + kv_head_offset + dims[None, :]
        # A bfloat16 cache under a float32 query widens here, so both products run in
        # float32; .to is a no-op when the dtypes match.
        k = tl.load(key_cache_ptr + offsets).to(query_ptr.dtype.element_ty)
        v = tl.load(value_cache_ptr + offsets).to(query_ptr.dtype.element_ty)
        k = dot_operand(k, INTERPRETED)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        acc, m_i, l_i = online_softmax_update(scores, v, acc, m_i, l_i, DOT_PRECISION, INTERPRETED)

    # The diagonal: key p is visible to the query at position x when p <= x; every query
    # sees key unmasked_end <= first, so no row's max stays -inf. Keys past the context are
    # still loaded masked: their slots hold stale data, which must not reach P @ V.
    causal_end = tl.minimum(seq_len, first + BLOCK_M)
    for tile_start in range(unmasked_end, causal_end, BLOCK_N):
        key_positions = tile_start + tl.arange(0, BLOCK_N)
        is_key = key_positions < seq_len
        cache_rows = paged_row_offsets(
            block_table_row_ptr, tile_start, seq_len, stride_cache_block, stride_cache_slot, BLOCK_N, BLOCK_SIZE
        )
        offsets = cache_rows[:, None] + kv_head_offset + dims[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=is_key[:, None], other=0.0).to(query_ptr.dtype.element_ty)
        v = tl.load(value_cache_ptr + offsets, mask=is_key[:, None], other=0.0).to(query_ptr.dtype.element_ty)
        k = dot_operand(k, INTERPRETED)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        is_visible = key_positions[None, :] <= query_positions[:, None]
        scores = tl.where(is_visible, scores, float("-inf"))
        acc, m_i, l_i = online_softmax_update(scores, v, acc, m_i, l_i, DOT_PRECISION, INTERPRETED)

    out = acc / l_i[:, None]
    out_offsets = (q_begin + tile_rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, cast_to(out, out_ptr.dtype.element_ty, INTERPRETED), mask=is_query[:, None])


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """query [T, H, D] (rows may be strided) -> out [T, H, D], contiguous. The caches hold
    the query's dtype or, under a float32 query, bfloat16.

    `max_query_len` (the longest chunk) sizes the grid without a device sync; `tiles`
    overrides the default launch shape, for tests and tuning.
    """
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    check_int("query_start_loc", query_start_loc, dims=1)
    check_devices(query=query, query_start_loc=query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc must have {num_reqs + 1} entries (requests + 1), got {query_start_loc.shape[0]}"
        )
    tiles = tiles or PrefillTiles.default(head_dim, query.element_size(), compute_capability(query.device))
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    grid = (triton.cdiv(max_query_len, tiles.block_m), num_reqs, num_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_SIZE=key_cache.shape[1],
        DOT_PRECISION=dot_precision(query.dtype),
        INTERPRETED=is_interpreter(),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
