"""The CPU decode attention kernel against the builds it replaced, alternating in one process.

    python bench/decode_attention.py [--rounds 10] [--threads 2]

On the bench model's attention shape (8 query / 4 KV heads of 64, block size 16), 32
requests with contexts of 300-800 tokens, blocks placed at random in the cache:

native     the kernel as it builds here (kernels/csrc/cpu_paged_decode_attention.cpp)
l1         the same, prefetching the next block into L1 (hint T0) instead of L2
no-bf16    bfloat16 only: built without AVX512-BF16 (-mno-avx512bf16), so the cache's rows
           widen to float32 before they are multiplied (what CPUs without it run)

in three dtypes: float32, bfloat16 (a bfloat16 model) and float32 queries over a bfloat16
cache (cache.kv_cache_dtype bfloat16 under a float32 model).

Each runs warm (one layer's cache, ~18 MB in bfloat16, read again and again: it stays in
L3) and cold (eight layers' caches read in turn, as a decode step does: ~150 MB, from
memory). Each arm's best round is its number (others' work on a shared machine only adds
time); prints ms per layer, the cache bytes per second, and each baseline / native ratio.
The variants are second builds (cpu_ops.build_variant, about a minute each the first time).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from baton.kernels import cpu_ops

LAYERS, REQUESTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 32, 8, 4, 64, 16
VARIANTS = {"l1": ["-DBATON_PREFETCH_LOCALITY=3"], "no-bf16": ["-mno-avx512bf16"]}


def _caches(dtype: torch.dtype, cache_dtype: torch.dtype):
    """Query, caches, one block table per layer, seq lens, and the bytes of K and V a layer reads."""
    rng = random.Random(0)
    lens = [rng.randint(300, 800) for _ in range(REQUESTS)]
    blocks = [(n + BLOCK - 1) // BLOCK for n in lens]
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(blocks) * LAYERS
    key_cache, value_cache = (
        torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(cache_dtype) for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for _ in range(LAYERS):
        table = torch.zeros(REQUESTS, max(blocks), dtype=torch.int32)
        for r, n in enumerate(blocks):
            table[r, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        tables.append(table)
    query = torch.randn(REQUESTS, HEADS, HEAD_DIM, generator=gen).to(dtype)
    nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * key_cache.element_size()
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ops.require()
    builds = {"native": torch.ops.baton_cpu}
    builds.update(
        {
            name: cpu_ops.build_variant(f"baton_bench_{name.replace('-', '_')}", flags)
            for name, flags in VARIANTS.items()
        }
    )
    print(
        f"decode attention, {REQUESTS} requests, contexts 300-800, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, "
        f"{args.threads} threads, best of {args.rounds} alternating rounds"
    )
    for dtype, cache_dtype in ((torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)):
        query, key_cache, value_cache, tables, lens, nbytes = _caches(dtype, cache_dtype)
        arms = [name for name in builds if name != "no-bf16" or dtype == torch.bfloat16]
        label = str(dtype).removeprefix("torch.") + ("" if cache_dtype == dtype else " query, bfloat16 cache")
        for mode, layers in (("warm", 1), ("cold", LAYERS)):
            best = dict.fromkeys(arms, float("inf"))
            for _ in range(args.rounds):
                for name in arms:
                    op = builds[name].paged_decode_attention
                    start = time.perf_counter()
                    for i in range(2 * LAYERS):
                        op(query, key_cache, value_cache, tables[i % layers], lens, 0.125)
                    best[name] = min(best[name], (time.perf_counter() - start) / (2 * LAYERS))
            native = best["native"]
            line = f"  {label:8} {mode}: native {native * 1e3:.3f} ms ({nbytes / native / 1e9:.1f} GB/s)"
            for name in arms[1:]:
                line += f", {name} {best[name] * 1e3:.3f} ms ({best[name] / native:.2f}x)"
            print(line)


if __name__ == "__main__":
    main()
