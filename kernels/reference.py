"""Torch reference implementations of every kernel (`<op>_ref`).

They define what each Triton kernel must compute, and they are the engine's CPU path, so
they favour clarity over speed but stay vectorised where a loop would dominate a step.

Shapes (T tokens in the batch, R requests, H heads, D head dim, N blocks of B slots):
    q, k, v          [T, H, D]
    key/value cache  [N, B, H_kv, D]          slot s lives at cache[s // B, s % B]
    block_tables     [R, max_blocks] int32    request r's token at position p is in
                                              block block_tables[r, p // B], slot p % B
    seq_lens         [R] int32                context length of r, including this step
    query_start_loc  [R + 1] int32            r's queries are q[qsl[r]:qsl[r + 1]], the
                                              last tokens of its context

The caches hold the activations' dtype or, under float32 activations, bfloat16
(kv_cache_dtype): K/V are rounded to it when stored and widened back when attended.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_cache_dtype


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's K/V into its slot, in the cache's dtype; slot -1 marks padding
    and is skipped."""
    check_cache_dtype("key_cache", key_cache, key.dtype, source="key")
    check_cache_dtype("value_cache", value_cache, value.dtype, source="value")
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if key.dtype != key_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# Decode requests are attended in groups of this many, sorted by context length: each
# group pads only to its own longest context, and its gathered K/V stay small enough for
# malloc to reuse (on CPU this made a 64-request decode step 20x faster than one padded batch).
DECODE_GROUP_SIZE = 4


def gather_context_ref(
    cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """[R, max_len, H_kv, D] in `dtype` (the query's): the first max_len slots of every
    request, through its table (whole blocks are gathered, then trimmed)."""
    num_blocks = -(-max_len // cache.shape[1])
    blocks = cache[block_tables[:, :num_blocks].long()]  # [R, num_blocks, B, H_kv, D]
    context = blocks.flatten(1, 2)[:, :max_len]
    return context if context.dtype == dtype else context.to(dtype)


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request ([R, H, D]) against its whole paged context. Slots past
    a request's length are masked out, but must hold finite values (engine caches do)."""
    check_cache_dtype("key_cache", key_cache, query.dtype)
    check_cache_dtype("value_cache", value_cache, query.dtype)
    out = torch.empty_like(query)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    lengths = seq_lens.tolist()
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for begin in range(0, len(order), DECODE_GROUP_SIZE):
        rows = order[begin : begin + DECODE_GROUP_SIZE]
        index = torch.tensor(rows, device=query.device)
        max_len = lengths[rows[-1]]
        keys = gather_context_ref(key_cache, block_tables[index], max_len, query.dtype).transpose(1, 2)
        values = gather_context_ref(value_cache, block_tables[index], max_len, query.dtype).transpose(1, 2)
        positions = torch.arange(max_len, device=query.device)
        mask = (positions[None, :] < seq_lens[index, None].to(positions.device))[:, None, None, :]
        # GQA: the query heads sharing a KV head become that head's "query positions"
        # ([R, H_kv, group, D]), so K/V are never repeated per query head.
        grouped = query[index].view(len(rows), num_kv_heads, group, head_dim)
        attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        out[index] = attended.reshape(len(rows), -1, head_dim)
    return out


def prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for query chunks over their paged context (earlier chunks or
    prefix-cache hits) plus themselves. Query i of a request with context length L and
    Q queries sits at position L - Q + i and sees positions 0 .. L - Q + i."""
    check_cache_dtype("key_cache", key_cache, query.dtype)
    check_cache_dtype("value_cache", value_cache, query.dtype)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        begin, end = starts[r], starts[r + 1]
        num_queries = end - begin
        if num_queries == 0:
            continue
        table = block_tables[r : r + 1]
        keys = gather_context_ref(key_cache, table, seq_len, query.dtype).transpose(1, 2)
        values = gather_context_ref(value_cache, table, seq_len, query.dtype).transpose(1, 2)
        q = query[begin:end].transpose(0, 1)[None]
        if num_queries == seq_len:
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[begin:end] = o[0].transpose(0, 1)
    return out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in float32, as Hugging Face Llama computes it. With `residual`, first
    adds it (x + residual, in x's dtype) and returns (normed, the new residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = x.float() * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype), residual


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> silu(gate) * up, in x's dtype (as Llama's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style RoPE applied in place to q [T, H, D] and k [T, H_kv, D].

    cos_sin_cache [max_pos, D] holds cos in the first D/2 columns and sin in the rest,
    in float32; the rotation is computed in float32 and stored back in q/k's dtype.
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (query, key):
        x1 = x[..., :half].float()
        x2 = x[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))
