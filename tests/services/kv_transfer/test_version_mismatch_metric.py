"""baton_kv_version_mismatches_total{role}: the decode side's count of handed-over K/V of
other weights (recomputed, see test_engine_handover.py) reaches Prometheus as a counter of
the worker's role, documented in services/metrics.py's header. Without Ray running, Ray's
metric objects take the calls and export nothing; what the exporter sends is its delta."""

from __future__ import annotations

from baton.services import metrics
from baton.services.engine.stats import EngineStats


def stats(mismatches: int) -> EngineStats:
    return EngineStats(0, 0, 0, 64, 64, 0.0, 0, 0, kv_version_mismatches=mismatches)


def test_the_counter_has_its_name_and_role_label_and_is_documented():
    counter = metrics._metrics()["kv_version_mismatches"]
    assert counter._name == "baton_kv_version_mismatches_total" and tuple(counter._tag_keys) == ("role",)
    assert "baton_kv_version_mismatches_total{role}" in metrics.__doc__


def test_the_engine_exporter_follows_the_engine_total():
    exporter = metrics.EngineMetrics("decode")
    exporter.export(stats(2))
    assert exporter.last.kv_version_mismatches == 2
    exporter.export(stats(5))  # exports the increase, 3
    assert exporter.last.kv_version_mismatches == 5
