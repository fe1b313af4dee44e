"""Every kernel compiles for Hopper (sm_90) and Ampere (sm_80) at its default launch shapes,
and the KV-cache kernels for a bfloat16 cache under float32 activations, on any machine: the interpreter never runs the compiler, so without this a compile-only
error (a type, a constexpr, too much shared memory) would first show on a GPU.

Triton cannot compile while TRITON_INTERPRET=1 (as the CPU tests set), so the compile runs
in a subprocess: this file, run as a script.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Most dynamic shared memory one block may use: sm_90 and sm_80.
SHARED_MEMORY_LIMITS = {90: 232448, 80: 166912}
INT32_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")
INT64_POINTERS = ("slot_mapping_ptr", "positions_ptr")
FLOAT32_ARGS = ("scale_log2", "eps")


def test_kernels_compile_for_sm90_and_sm80():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled" in result.stdout


def compile_for(arch: int, kernel, dtype: str, constexprs: dict, num_warps: int = 4, num_stages: int = 3, **pointers):
    """Compiles `kernel` with every pointer of `dtype` unless named in `pointers`; checks
    that its shared memory fits the architecture."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in INT32_POINTERS:
            signature[name] = "*i32"
        elif name in INT64_POINTERS:
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FLOAT32_ARGS else "i32"
    if "INTERPRETED" in kernel.arg_names:
        constexprs = {**constexprs, "INTERPRETED": False}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    shared = compiled.metadata.shared
    assert shared <= SHARED_MEMORY_LIMITS[arch], f"{kernel.__name__} {constexprs} needs {shared} B of shared memory"


def main() -> None:
    from baton.kernels import paged_decode_attention as decode
    from baton.kernels import prefill_attention as prefill
    from baton.kernels import reshape_and_cache, rms_norm, rotary

    for arch in SHARED_MEMORY_LIMITS:
        for dtype, cache_dtype, precision, head_dim in (
            ("bf16", "bf16", "tf32", 128),
            ("fp32", "fp32", "ieee", 128),
            ("fp32", "bf16", "ieee", 128),
            ("bf16", "bf16", "tf32", 256),
        ):
            caches = dict(key_cache_ptr=f"*{cache_dtype}", value_cache_ptr=f"*{cache_dtype}")
            tiles = decode.DecodeTiles.default(head_dim)
            for is_split in (False, True):
                split_pointers = dict(out_ptr="*fp32", lse_ptr="*fp32") if is_split else {}
                constexprs = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_G=16, BLOCK_N=tiles.block_n, BLOCK_SIZE=16)
                constexprs |= dict(IS_SPLIT=is_split, DOT_PRECISION=precision)
                launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
                compile_for(arch, decode._decode_kernel, dtype, constexprs, **launch, **split_pointers, **caches)
            reduce_constexprs = dict(HEAD_DIM=head_dim, BLOCK_S=8)
            compile_for(
                arch, decode._reduce_splits_kernel, dtype, reduce_constexprs, partial_ptr="*fp32", lse_ptr="*fp32"
            )
            tiles = prefill.PrefillTiles.default(head_dim, element_size=4 if dtype == "fp32" else 2, sm=arch)
            constexprs = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_SIZE=16)
            constexprs |= dict(DOT_PRECISION=precision)
            compile_for(arch, prefill._prefill_kernel, dtype, constexprs, tiles.num_warps, tiles.num_stages, **caches)
        constexprs = dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_SIZE=16)
        for dtype in ("bf16", "fp32"):
            caches = dict(key_cache_ptr="*bf16", value_cache_ptr="*bf16")
            compile_for(arch, reshape_and_cache._reshape_and_cache_kernel, dtype, constexprs, **caches)
        for has_residual in (False, True):
            constexprs = dict(N=4096, BLOCK=4096, HAS_RESIDUAL=has_residual)
            compile_for(arch, rms_norm._rms_norm_kernel, "bf16", constexprs, num_warps=16)
        constexprs = dict(NUM_HEADS=32, NUM_KV_HEADS=8, BLOCK_H=32, BLOCK_KV_H=8, HALF=64)
        compile_for(arch, rotary._rotary_kernel, "bf16", constexprs, cos_sin_cache_ptr="*fp32")
    print("compiled")


if __name__ == "__main__":
    main()
