"""C++ kernels for the CPU (kernels/csrc), built on first use.

`torch.utils.cpp_extension` compiles them with the machine's C++ compiler for the machine's
own CPU (-march=native) into torch's extension cache (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), once per source change; other processes load the built library,
and a file lock keeps concurrent builds apart. The first build takes about 20 s. Each copy
of Baton (a checkout, an installed package) builds into a folder of its own
(`library_name`): two copies with different sources, such as a CI clone beside a working
tree, would otherwise rebuild over each other there, and a process could load the other
copy's library.

Where no compiler is found or the build fails, `available()` is False, a warning says why
(once per process), and `ops` falls back to the torch references; BATON_CPU_KERNELS=0 turns
the kernels off on purpose. ops.py's `impl="cpp"` asks for them and raises if they cannot
be built.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "cpu_paged_decode_attention.cpp",
        "cpu_fused_ops.cpp",
        "cpu_int8_linear.cpp",
        "cpu_w8a8_linear.cpp",
        "cpu_blocked_linear.cpp",
        "cpu_paged_prefill_attention.cpp",
        "thread_pool.cpp",
    )
]
# -ffast-math lets exp and the reductions vectorize; infinities still have to work (the
# online softmax starts from -inf), hence -fno-finite-math-only.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
ENV_SWITCH = "BATON_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str, "prefill_max_group": int


class CpuKernelsUnavailable(RuntimeError):
    pass


def available() -> bool:
    """Builds (or loads) the kernels on the first call; False when they cannot be had."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                _build()
    return bool(_state["ok"])


def require() -> None:
    if not available():
        raise CpuKernelsUnavailable(f"Baton's CPU kernels are unavailable: {_state['error']}")


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    """[R, H, D] queries against their paged contexts (see the .cpp file)."""
    require()
    return torch.ops.baton_cpu.paged_decode_attention(
        query.contiguous(),
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        float(scale),
    )


def set_thread_pool(on: bool) -> bool:
    """Turns the kernels' own thread pool (csrc/thread_pool.h) on or off for this process;
    returns whether it was on. BATON_CPU_THREAD_POOL=1 turns it on from the start."""
    require()
    return bool(torch.ops.baton_cpu.set_thread_pool(on))


def prefill_attention_max_group() -> int:
    """The most query heads per KV head `paged_prefill_attention` takes: a vector's lanes, 16
    on AVX-512 CPUs and 8 on AVX2 ones; 0 where it has no kernel."""
    if "prefill_max_group" not in _state:  # asked per layer per step: read once
        _state["prefill_max_group"] = int(torch.ops.baton_cpu.prefill_attention_max_group()) if available() else 0
    return int(_state["prefill_max_group"])


def prefill_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `paged_prefill_attention` has a kernel for these heads (head sizes 64, 128 and
    256, up to `prefill_attention_max_group()` query heads per KV head)."""
    return head_dim in (64, 128, 256) and 0 < num_heads // num_kv_heads <= prefill_attention_max_group()


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale: float):
    """Causal attention of each request's query chunk ([T, H, D]) over its paged context, as
    `reference.prefill_attention_ref` (see the .cpp file)."""
    require()
    return torch.ops.baton_cpu.paged_prefill_attention(
        query,
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        float(scale),
    )


def rms_norm(x, weight, eps: float, residual=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual) as `reference.rms_norm_ref`, in one pass per row; x (and
    residual) contiguous."""
    require()
    out, new_residual = torch.ops.baton_cpu.rms_norm(x, weight, float(eps), residual)
    return out, (new_residual if residual is not None else None)


def silu_and_mul(x) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> silu(gate) * up, as `reference.silu_and_mul_ref`; x contiguous."""
    require()
    return torch.ops.baton_cpu.silu_and_mul(x)


def rotary_embedding_and_cache(
    positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping
) -> None:
    """Rotates query and key in place and writes the rotated keys and the values into the
    caches at their slots (slot -1: not written), in one pass per token."""
    require()
    torch.ops.baton_cpu.rotary_embedding_and_cache(
        positions.to(torch.int64).contiguous(),
        query,
        key,
        value,
        cos_sin_cache.contiguous(),
        key_cache,
        value_cache,
        slot_mapping.to(torch.int64).contiguous(),
    )


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package (a dependency) puts it beside the venv's
    Python, which is not on PATH when the interpreter is called by its full path."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def library_name(library: str, csrc: Path = SOURCES[0].parent) -> str:
    """The extension's name, and so its folder in torch's cache: `library` tagged with this
    copy of the sources' location."""
    return f"{library}_{hashlib.sha256(str(csrc.resolve()).encode()).hexdigest()[:10]}"


def _load(name: str, extra_cflags: list[str]) -> None:
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    load(
        name=library_name(name),
        sources=[str(path) for path in SOURCES],
        extra_cflags=CFLAGS + extra_cflags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def build_variant(library: str, extra_cflags: list[str]):
    """A second copy of the kernels, built with `extra_cflags` after -march=native and
    registered as torch.ops.<library> beside baton_cpu (csrc/op_library.h). The tests build
    the AVX2 paths this way on AVX-512 machines (`-mno-avx512f`), which would otherwise ship
    untested wherever CI runs on AVX-512. Raises what the build raises."""
    _load(f"{library}_kernels", [*extra_cflags, f"-DBATON_CPU_LIB={library}"])
    return getattr(torch.ops, library)


def _build() -> None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _state.update(ok=False, error=f"turned off by {ENV_SWITCH}=0")
        return
    try:
        _load("baton_cpu_kernels", [])
    except Exception as e:  # no compiler, no ninja, a failed build: the references still work
        last_line = (str(e).strip().splitlines() or [""])[-1]  # a compiler's last line says why
        error = f"{type(e).__name__}: {last_line}"
        _state.update(ok=False, error=error)
        logger.warning("Baton's CPU kernels could not be built (%s); using the torch reference kernels", error)
        return
    _state.update(ok=True, error="")
