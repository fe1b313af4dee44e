#!/usr/bin/env python3
"""GPU check of Baton's Triton kernels: the kernel tests compiled on CUDA, then benchmarks.

    make gpu-check                  PYTHON=python3 make gpu-check
    python3 bench/gpu_check.py [--peak-bandwidth-tbs 4.8] [--skip-tests] [--no-sweep]

1. Tests: tests/kernels under pytest, compiled (TRITON_INTERPRET unset), one process per
   test file at once so Triton compiles on every core. The engine-level test needs
   transformers, tokenizers, safetensors, pydantic and numpy; without them it is left out,
   and the summary says so.
2. Paged decode attention: batch 64, context 4096, bf16, Llama-3-8B heads (32 query heads,
   8 KV heads, head_dim 128), 16-token blocks in shuffled order. Achieved HBM bandwidth is
   the bytes the kernel must move (K/V of every context, q, out, block tables) over its
   median time, against the device's peak. Goal: >= 70%. Also batch 4 at context 32k,
   where split-K has to fill the GPU.
3. Prefill attention: causal, bf16, same heads, against torch SDPA on the same shapes with
   contiguous K/V (the fastest of SDPA's flash / cuDNN / memory-efficient backends; K/V
   pre-expanded to all query heads so every backend runs). Goal: >= 0.8x SDPA's TFLOP/s.
4. The engine's decode step on the bench model, eager against CUDA graphs
   (bench/gpu_decode_graphs.py; needs the engine test's packages).

The sweeps after each default run try other launch shapes and split counts, so one run on
a new GPU says whether the defaults need retuning. `--smoke` runs tiny shapes on the CPU
under the Triton interpreter, to check this script without a GPU.

Needs only torch and Triton (pytest for step 1; the engine test's packages for step 4); it
never imports Ray, which the GPU machine does not have. Without an installed `baton`, it
links the repository's folders into a temporary `baton` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DECODE_GOAL = 0.70  # of peak HBM bandwidth
PREFILL_GOAL = 0.80  # of SDPA's throughput
ENGINE_TEST = "test_engine_triton.py"
ENGINE_TEST_DEPS = ("transformers", "tokenizers", "safetensors", "pydantic", "numpy")
# Peak HBM bandwidth in TB/s by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_HBM_TBS = [
    ("H200", 4.8),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),  # SXM5, HBM3
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),  # 40 GB
]


@dataclass(frozen=True)
class Heads:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Plan:
    device: str
    heads: Heads
    block_size: int
    decode_cases: tuple[tuple[int, int], ...]  # (batch, context); the first one carries the goal
    prefill_cases: tuple[tuple[int, int], ...]  # (sequences, tokens each)
    sweep: bool


GPU_PLAN = Plan("cuda", Heads(32, 8, 128), 16, ((64, 4096), (4, 32768)), ((8, 2048), (2, 8192)), sweep=True)
SMOKE_PLAN = Plan("cpu", Heads(4, 2, 16), 16, ((2, 40),), ((1, 48),), sweep=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-bandwidth-tbs", type=float, help="peak HBM bandwidth in TB/s (default: by GPU name)")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--skip-bench", action="store_true", help="tests only")
    parser.add_argument("--no-sweep", action="store_true", help="default launch shapes only, no tuning sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny benchmarks on the CPU interpreter (no tests)")
    args = parser.parse_args()

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        plan = SMOKE_PLAN
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        plan = replace(GPU_PLAN, sweep=not args.no_sweep)
    import torch
    import triton

    if plan.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU; none is visible (--smoke checks this script on the CPU).")
        return 2
    extra_env = ensure_baton_importable()
    name = torch.cuda.get_device_name() if plan.device == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")

    summary: list[str] = []
    tests_ok = True
    if not args.skip_tests and not args.smoke:
        tests_ok, line = run_tests(extra_env)
        summary.append(line)
    if not args.skip_bench:
        peak = args.peak_bandwidth_tbs or (peak_bandwidth_tbs(name) if plan.device == "cuda" else None)
        for i, (batch, context) in enumerate(plan.decode_cases):
            summary.append(decode_case(plan, batch, context, peak, is_goal=i == 0))
        for num_seqs, seq_len in plan.prefill_cases:
            summary.append(prefill_case(plan, num_seqs, seq_len))
        missing = missing_engine_deps()
        if plan.device != "cuda":
            summary.append("engine decode step with CUDA graphs: not run (no CUDA)")
        elif missing:
            summary.append(f"engine decode step with CUDA graphs: not run (missing {', '.join(missing)})")
        else:
            from gpu_decode_graphs import decode_graphs_case

            summary.append(decode_graphs_case())

    print("\n== summary ==")
    for line in summary:
        print(line)
    return 0 if tests_ok else 1


def missing_engine_deps() -> list[str]:
    """What the engine's GPU test and the CUDA-graph bench import that is not installed."""
    return [m for m in ENGINE_TEST_DEPS if importlib.util.find_spec(m) is None]


def ensure_baton_importable() -> dict[str, str]:
    """Environment additions that let subprocesses import `baton.kernels` too."""
    if importlib.util.find_spec("baton") is not None:
        return {}
    shim = Path(tempfile.mkdtemp(prefix="baton-import-"))
    (shim / "baton").mkdir()
    for package in ("kernels", "services"):
        (shim / "baton" / package).symlink_to(REPO / package)
    sys.path.insert(0, str(shim))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)}


def peak_bandwidth_tbs(device_name: str) -> float | None:
    for key, tbs in PEAK_HBM_TBS:
        if key in device_name:
            return tbs
    print(f"no peak bandwidth known for {device_name!r}: pass --peak-bandwidth-tbs for a ratio")
    return None


# ---------------------------------------------------------------------------- tests


def run_tests(extra_env: dict[str, str]) -> tuple[bool, str]:
    if importlib.util.find_spec("pytest") is None:
        print("pytest is not installed: the kernel tests were NOT run")
        return False, "kernel tests: NOT RUN (no pytest)"
    files = sorted((REPO / "tests" / "kernels").glob("test_*.py"))
    missing = missing_engine_deps()
    left_out = ""
    if missing:
        files = [f for f in files if f.name != ENGINE_TEST]
        left_out = f"; {ENGINE_TEST} left out (missing {', '.join(missing)})"
    env = {**os.environ, **extra_env}
    env.pop("TRITON_INTERPRET", None)
    print(f"\n== kernel tests, compiled: {len(files)} files in parallel ==")
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    capture = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [(f.name, subprocess.Popen([*command, str(f)], cwd=REPO, env=env, **capture)) for f in files]
    all_ok = True
    for name, proc in procs:
        output, _ = proc.communicate()
        ok = proc.returncode == 0
        all_ok &= ok
        lines = output.strip().splitlines()
        print(f"{name}: {'ok' if ok else 'FAILED'}: {lines[-1] if lines else '(no output)'}")
        if not ok:
            print(output)
    elapsed = time.perf_counter() - start
    return all_ok, f"kernel tests (compiled): {'PASS' if all_ok else 'FAIL'} in {elapsed:.0f}s{left_out}"


# ---------------------------------------------------------------------------- benchmarks


def bench_ms(fn, device: str) -> float | None:
    """Median milliseconds, or None when the launch shape does not run on this GPU."""
    from triton.testing import do_bench

    try:
        if device != "cuda":  # the interpreter: one timed call says the script works, nothing more
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    except Exception as e:  # e.g. OutOfResources: a swept shape needs more shared memory
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
        return None


def shuffled_paged_kv(plan: Plan, num_seqs: int, seq_len: int, dtype):
    """Contiguous K/V [num_seqs, seq_len, H_kv, D] and the same values in a paged cache whose
    blocks are in random order, as a long-running server's are."""
    import torch

    heads, block_size = plan.heads, plan.block_size
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    block_shape = (block_size, heads.num_kv_heads, heads.head_dim)
    key, value = (torch.randn((num_blocks, *block_shape), dtype=dtype, device=plan.device) for _ in range(2))
    order = torch.randperm(num_blocks, device=plan.device)
    kv_cache = torch.empty((2, num_blocks, *block_shape), dtype=dtype, device=plan.device)
    kv_cache[0, order] = key
    kv_cache[1, order] = value
    block_tables = order.view(num_seqs, blocks_per_seq).int()
    as_seqs = (num_seqs, blocks_per_seq * block_size, heads.num_kv_heads, heads.head_dim)
    return key.view(as_seqs)[:, :seq_len], value.view(as_seqs)[:, :seq_len], kv_cache, block_tables


def decode_case(plan: Plan, num_seqs: int, seq_len: int, peak_tbs: float | None, is_goal: bool) -> str:
    import torch
    from baton.kernels.paged_decode_attention import DecodeTiles, choose_num_splits, paged_decode_attention

    heads, dtype = plan.heads, torch.bfloat16
    print(f"\n== paged decode attention: batch {num_seqs}, context {seq_len}, bf16, {heads} ==")
    _, _, kv_cache, block_tables = shuffled_paged_kv(plan, num_seqs, seq_len, dtype)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=plan.device)
    query = torch.randn(num_seqs, heads.num_heads, heads.head_dim, dtype=dtype, device=plan.device)
    kv_bytes = 2 * num_seqs * seq_len * heads.num_kv_heads * heads.head_dim * kv_cache.element_size()
    num_bytes = kv_bytes + 2 * query.numel() * query.element_size() + block_tables.numel() * 4
    args = (kv_cache[0], kv_cache[1], block_tables, seq_lens, heads.head_dim**-0.5)

    def run(num_splits=None, tiles=None):
        return paged_decode_attention(query, *args, max_seq_len=seq_len, num_splits=num_splits, tiles=tiles)

    def report(label: str, ms: float | None) -> float:
        if ms is None:
            return 0.0
        tbs = num_bytes / ms / 1e9
        ratio = f", {tbs / peak_tbs:.0%} of peak {peak_tbs} TB/s" if peak_tbs else ""
        print(f"{label:64s} {ms * 1e3:9.1f} us  {tbs:6.3f} TB/s{ratio}")
        return tbs

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if plan.device == "cuda" else 1
    chosen = choose_num_splits(num_seqs, heads.num_kv_heads, seq_len, num_sms)
    default_tbs = report(f"default: {DecodeTiles.default(heads.head_dim)}, {chosen} splits", bench_ms(run, plan.device))
    best = (default_tbs, "default")
    if plan.sweep:
        shapes = (DecodeTiles(64, 4, 3), DecodeTiles(32, 4, 3), DecodeTiles(128, 8, 3), DecodeTiles(64, 8, 2))
        for num_splits in sorted({1, 2, 4, 8, chosen}):
            for tiles in shapes:
                label = f"{tiles}, {num_splits} splits"
                tbs = report(label, bench_ms(lambda s=num_splits, t=tiles: run(s, t), plan.device))
                best = max(best, (tbs, label))
        print(f"best: {best[1]} at {best[0]:.2f} TB/s")
    line = f"decode b{num_seqs} ctx{seq_len} ({chosen} splits): {default_tbs:.2f} TB/s"
    if peak_tbs:
        ratio = default_tbs / peak_tbs
        line += f" = {ratio:.0%} of peak {peak_tbs} TB/s"
        if is_goal:
            line += f" (goal >= {DECODE_GOAL:.0%}: {'MET' if ratio >= DECODE_GOAL else 'MISSED'})"
    if plan.sweep:
        line += f"; best swept: {best[0]:.2f} TB/s ({best[1]})"
    return line


def prefill_case(plan: Plan, num_seqs: int, seq_len: int) -> str:
    import torch
    import torch.nn.functional as F
    from baton.kernels.attention_tiles import compute_capability
    from baton.kernels.prefill_attention import PrefillTiles, prefill_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, dtype = plan.heads, torch.bfloat16
    group = heads.num_heads // heads.num_kv_heads
    print(f"\n== prefill attention: {num_seqs} x {seq_len} tokens, causal, bf16, {heads} ==")
    key, value, kv_cache, block_tables = shuffled_paged_kv(plan, num_seqs, seq_len, dtype)
    query = torch.randn(num_seqs, seq_len, heads.num_heads, heads.head_dim, dtype=dtype, device=plan.device)
    flops = 4 * num_seqs * heads.num_heads * heads.head_dim * seq_len * (seq_len + 1) // 2
    scale = heads.head_dim**-0.5

    # SDPA on [B, H, L, D], K/V expanded to every query head (GQA support varies by backend).
    q_sdpa = query.transpose(1, 2).contiguous()
    k_sdpa = key.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    v_sdpa = value.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()

    def sdpa():
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, is_causal=True, scale=scale)

    sdpa_ms: dict[str, float] = {}
    reference = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel([backend]):
            try:
                reference = sdpa()
            except RuntimeError as e:
                print(f"SDPA {backend.name}: unavailable ({str(e).splitlines()[0][:80]})")
                continue
            ms = bench_ms(sdpa, plan.device)
        if ms is not None:
            sdpa_ms[backend.name] = ms
            print(f"SDPA {backend.name}: {ms:.3f} ms  {flops / ms / 1e9:.1f} TFLOP/s")

    flat_query = query.view(num_seqs * seq_len, heads.num_heads, heads.head_dim)
    query_start_loc = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=plan.device) * seq_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=plan.device)
    args = (kv_cache[0], kv_cache[1], block_tables, query_start_loc, seq_lens, scale, seq_len)

    def run(tiles=None):
        return prefill_attention(flat_query, *args, tiles)

    out = run().view(num_seqs, seq_len, heads.num_heads, heads.head_dim).transpose(1, 2)
    max_err = float("nan") if reference is None else (out.float() - reference.float()).abs().max().item()
    print(f"max |ours - SDPA|: {max_err:.4f}")
    sm = compute_capability(query.device)
    default_tiles = PrefillTiles.default(heads.head_dim, query.element_size(), sm)
    ours_ms = bench_ms(run, plan.device)
    if ours_ms is None:
        return f"prefill {num_seqs}x{seq_len}: FAILED with the default {default_tiles}"
    print(f"ours, default {default_tiles}: {ours_ms:.3f} ms  {flops / ours_ms / 1e9:.1f} TFLOP/s")
    best = (ours_ms, str(default_tiles))
    if plan.sweep:
        for tiles in (
            PrefillTiles(128, 64, 8, 3),
            PrefillTiles(128, 64, 4, 3),
            PrefillTiles(128, 128, 8, 2),
            PrefillTiles(128, 128, 8, 3),
            PrefillTiles(64, 64, 4, 3),
            PrefillTiles(128, 32, 4, 3),
            PrefillTiles(64, 128, 4, 2),
            PrefillTiles(128, 64, 8, 4),
        ):
            ms = bench_ms(lambda t=tiles: run(t), plan.device)
            if ms is not None:
                print(f"ours, {tiles}: {ms:.3f} ms  {flops / ms / 1e9:.1f} TFLOP/s")
                best = min(best, (ms, str(tiles)))
    line = f"prefill {num_seqs}x{seq_len}: {flops / ours_ms / 1e9:.1f} TFLOP/s"
    if not sdpa_ms:
        return line + "; no SDPA backend ran, no ratio"
    sdpa_name = min(sdpa_ms, key=sdpa_ms.get)
    ratio = sdpa_ms[sdpa_name] / ours_ms
    met = "MET" if ratio >= PREFILL_GOAL else "MISSED"
    line += (
        f" vs SDPA {sdpa_name} {flops / sdpa_ms[sdpa_name] / 1e9:.1f} = {ratio:.2f}x (goal >= {PREFILL_GOAL}x: {met})"
    )
    line += f"; max |ours - SDPA| {max_err:.3f}"
    if plan.sweep:
        line += f"; best swept: {sdpa_ms[sdpa_name] / best[0]:.2f}x ({best[1]})"
    return line


if __name__ == "__main__":
    sys.exit(main())
