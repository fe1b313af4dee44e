"""What the test machine's CPU has, for tests whose kernel paths depend on it."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo ("avx2", "avx512f", "amx_bf16", ...);
    empty where there is no /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
