"""baton_kv_version_mismatches_total{role} and baton_kv_dtype_mismatches_total{role}: the
decode side's counts of handed-over K/V it recomputed rather than read, because other weights
or a cache of another dtype produced them (see test_engine_handover.py), reach Prometheus as
counters of the worker's role, documented in services/metrics.py's header. Without Ray
running, Ray's metric objects take the calls and export nothing; what the exporter sends is
its delta."""

from __future__ import annotations

import pytest
from baton.services import metrics
from baton.services.engine.stats import EngineStats

COUNTERS = [
    ("kv_version_mismatches", "baton_kv_version_mismatches_total"),
    ("kv_dtype_mismatches", "baton_kv_dtype_mismatches_total"),
]


def stats(field: str, count: int) -> EngineStats:
    return EngineStats(0, 0, 0, 64, 64, 0.0, 0, 0, **{field: count})


@pytest.mark.parametrize(("field", "name"), COUNTERS)
def test_the_counter_has_its_name_and_role_label_and_is_documented(field, name):
    counter = metrics._metrics()[field]
    assert counter._name == name and tuple(counter._tag_keys) == ("role",)
    assert f"{name}{{role}}" in metrics.__doc__


@pytest.mark.parametrize(("field", "name"), COUNTERS)
def test_the_engine_exporter_follows_the_engine_total(field, name):
    exporter = metrics.EngineMetrics("decode")
    exporter.export(stats(field, 2))
    assert getattr(exporter.last, field) == 2
    exporter.export(stats(field, 5))  # exports the increase, 3
    assert getattr(exporter.last, field) == 5
    other = next(f for f, _ in COUNTERS if f != field)
    assert getattr(exporter.last, other) == 0
