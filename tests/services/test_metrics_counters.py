"""The reliability counters other components record (migrations, sheds, fenced replicas, and
cancels in baton_requests_total): names, labels, and that each is documented in the module's
header. Without Ray running, Ray's metric objects take the calls and export nothing."""

from __future__ import annotations

import pytest
from baton.services import metrics

COUNTERS = {
    "shed": ("baton_requests_shed_total", ("api", "reason")),
    "migrations": ("baton_request_migrations_total", ("role", "outcome")),
    "fenced": ("baton_replicas_fenced_total", ("role",)),
    "requests": ("baton_requests_total", ("finish_reason", "api")),
}


@pytest.mark.parametrize("key", sorted(COUNTERS))
def test_counters_have_their_names_and_labels(key):
    name, labels = COUNTERS[key]
    counter = metrics._metrics()[key]
    assert counter._name == name and tuple(counter._tag_keys) == labels
    assert f"{name}{{{','.join(labels)}}}" in metrics.__doc__  # documented with its labels


def test_record_functions_take_their_labels():
    metrics.record_shed("http", "gateway_inflight")
    metrics.record_fenced("decode")
    for outcome in sorted(metrics.MIGRATION_OUTCOMES):
        metrics.record_migration("decode", outcome)
    metrics.record_cancelled("grpc")


def test_a_migration_outcome_outside_the_documented_ones_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        metrics.record_migration("decode", "ok")
