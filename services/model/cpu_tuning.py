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
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys

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
