"""Fixtures for the chart's checks: the real helm binary (fetched once, see
tests/testlib/helm_binary.py) and each values file of helm/values rendered once."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
from testlib.helm_binary import HelmUnavailable, helm_binary
from testlib.helm_chart import HelmChart, Manifest, values_file


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
