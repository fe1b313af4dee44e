"""Tiny random models for tests, built once per machine and cached under .baton/."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO / ".baton" / "test-models"
# Bump when the tiny-model builder changes in a way that alters weights or tokenizer.
BUILDER_VERSION = 1


def tiny_model(arch: str = "llama", preset: str = "tiny", **overrides) -> Path:
    """A cached model folder; built (a few seconds) the first time it is asked for."""
    from baton.services.model.tiny import make_tiny_model

    key = json.dumps({"arch": arch, "preset": preset, "v": BUILDER_VERSION, **overrides}, sort_keys=True)
    path = MODEL_CACHE / f"{arch}-{preset}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(tmp, arch=arch, preset=preset, **overrides)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path
