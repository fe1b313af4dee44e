"""Shared fixtures. Helpers live in tests/testlib (on sys.path via pytest's pythonpath)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels run under the interpreter on machines without CUDA. Set before any kernel
# module is imported (kernels are imported lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from testlib.models import tiny_model


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def model_dir(request) -> Path:
    return tiny_model(request.param)
