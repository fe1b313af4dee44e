"""Process-level tuning for running models on the CPU.

Memory. glibc's malloc serves allocations above its mmap threshold (128 KiB by default, adapting
upwards) with fresh mmap()ed pages and gives them back on free, so every step's large
activations pay page faults again. Raising the threshold to glibc's maximum (32 MiB) and
keeping freed memory in the heap made a 2048x512 @ 512x3072 matmul 25% faster and a 25 MB
gather 3.5x faster on the benchmark machine. It is what tcmalloc/jemalloc preloading does
for PyTorch CPU inference, without needing a preload. Set BATON_CPU_MALLOC_TUNING=0 to skip.

Threads. PyTorch's CPU build uses GNU OpenMP, and every thread that runs a large torch op
becomes the master of an OpenMP team whose workers live as long as that thread. Once the
process holds more OpenMP threads than it has cores, libgomp stops spinning at barriers
and parks workers in futex waits instead (its "throttled" spin count), which made a
16x512 @ 512x1536 linear 2x slower and the engine's decode step 35% slower on the
benchmark machine. So the engine's step loop is the only thread with a team: it also
builds the model, and helper threads that touch tensors (KV transfers) run their torch
ops serially through `run_torch_serially_in_this_thread`.

oneDNN's caches. A oneDNN linear builds a primitive for each (weight shape, row count) and keeps
it in two LRU caches (ideep's and oneDNN's own, 1024 entries each, ~0.26 MB per entry in each at
the tiny model's sizes; heaptrack). A serving engine sees every row count up to
max_num_batched_tokens, so over identical 128-stream rounds a decode replica's idle RSS went
527 -> 644 -> 714 -> 735 -> 742 -> 744 MB, and a sweep of 1024 row counts held 786 MB, still
growing as the caches churned. It is live memory, not fragmentation (malloc_trim gave back
12 MB) nor Python objects (tracemalloc flat). `pad_rows_for_onednn` pads to one of about eight
sizes per octave (`onednn_rows`): the sweep then held 95 MB, flat, and ran faster (no primitive
built per new count); with `linear` padding its rows (model/linear.py) the soak
(tests/services/workers/test_memory_soak.py) read 527 -> 577 -> 580 -> 583 -> 584 -> 586 MB.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's cap on 64-bit
_TRIM_THRESHOLD = 2**30
_applied = False
_omp: ctypes.CDLL | None | bool = None  # None: not looked up yet; False: not GNU OpenMP


def tune_malloc_for_cpu_inference() -> bool:
    """Applies the malloc settings once per process; True if they are in effect."""
    global _applied  # process-wide by nature: malloc has one configuration per process
    if _applied:
        return True
    if os.environ.get("BATON_CPU_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    _applied = bool(ok)
    if _applied:
        logger.info("raised malloc's mmap threshold to %d bytes for CPU inference", _MAX_MMAP_THRESHOLD)
    return _applied


def release_freed_memory(device: torch.device) -> None:
    """Hands memory that tensors no longer use back to the system, after sleep frees the KV
    cache: CUDA's caching allocator keeps it for torch, and on the CPU malloc's heap keeps it
    (the tuning above). The heap holds every per-layer tensor of up to 32 MiB, and larger ones
    too when its free top was big enough to serve them: glibc tries the top before mmap."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "cpu":
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing kept to trim
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def onednn_rows(num_rows: int) -> int:
    """The row count to run a oneDNN linear of `num_rows` rows at (see the module's docstring):
    the count itself up to 8, a multiple of 8 up to 64, then a multiple of an eighth of the
    power of two below it, so at most 12.5% of the rows are padding past 64. Small decode
    batches run unpadded: oneDNN's 8-row kernel read the bench model's 117 MB of weights in
    9.0 ms where its 1-row kernel took 6.8 ms (2 threads), and 1-7 rows add only seven
    primitives per weight shape."""
    if num_rows <= 8:
        return max(1, num_rows)
    if num_rows <= 64:
        return -(-num_rows // 8) * 8
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def pad_rows_for_onednn(x: torch.Tensor) -> torch.Tensor:
    """`x` as contiguous rows [num_rows, features], zero-padded up to `onednn_rows(num_rows)`;
    the caller keeps the first num_rows rows of the result."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    padded_rows = onednn_rows(num_rows)
    if padded_rows == num_rows:
        return rows.contiguous()
    padded = rows.new_empty(padded_rows, rows.shape[1])
    padded[:num_rows] = rows
    padded[num_rows:] = 0
    return padded


def run_torch_serially_in_this_thread() -> bool:
    """Makes torch ops on the calling thread run on this thread alone, so it never starts an
    OpenMP team of its own (see the module's docstring). Other threads keep their settings.
    True if it took effect (False where torch does not use GNU OpenMP)."""
    import torch

    omp = _gnu_openmp()
    if omp is None:
        return False
    torch.get_num_threads()  # torch sets a thread's OpenMP thread count on its first use: before ours
    omp.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


def _gnu_openmp() -> ctypes.CDLL | None:
    global _omp  # the library is loaded once per process
    if _omp is None:
        _omp = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):  # not loaded: torch uses another OpenMP
                # torch has loaded it already: dlopen by soname returns that copy.
                _omp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    return _omp or None
