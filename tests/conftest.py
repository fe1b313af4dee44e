"""Shared fixtures. Helpers live in tests/testlib (on sys.path via pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path

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
