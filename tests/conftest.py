"""Shared fixtures. Helpers live in tests/testlib (on sys.path via pytest's pythonpath)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels run under the interpreter on machines without CUDA. Set before any kernel
# module is imported (kernels are imported lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import functools
import sys
from collections.abc import Callable

import pytest
from testlib.helm_binary import HelmUnavailable, helm_binary
from testlib.helm_chart import HelmChart, Manifest, values_file
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


# The Helm chart, for tests/helm and the Serve entry point's tests: the real helm binary
# (fetched once, see tests/testlib/helm_binary.py) and each values file of helm/values
# rendered once per session.
@pytest.fixture(scope="session")
def chart() -> HelmChart:
    try:
        return HelmChart(helm_binary())
    except HelmUnavailable as e:
        pytest.fail(f"the chart checks need the helm binary: {e}", pytrace=False)


@pytest.fixture(scope="session")
def rendered(chart: HelmChart) -> Callable[[str], list[Manifest]]:
    """`rendered("gpu-tp2")`: the objects `helm template` prints for that values file (a fresh
    copy each call, so a test may change them)."""
    render = functools.cache(lambda name: chart.render([values_file(name)]))
    return lambda name: copy.deepcopy(render(name))


# The suite starts and stops Ray in this process many times (tests/testlib/ray_cluster.py,
# the launcher's and gateway's tests). Ray's native threads (the core worker's io threads,
# Serve's router loop) outlive ray.shutdown(), and tearing the interpreter down with them
# alive can crash the process after every test has passed (ray-project/ray#31145 is the same
# class of crash), which turns a green run red. Once pytest has reported, the outcome is
# decided: the process ends with pytest's exit status, without finalizing the interpreter.
_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _exit_status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
