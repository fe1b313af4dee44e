"""Key layout: one namespace per prefix and model, carrying a Redis Cluster hash tag."""

from __future__ import annotations

import pytest
from baton.services.router import Keyspace


def test_every_key_shares_the_models_hash_tag():
    keys = Keyspace("baton", "llama-3")
    assert keys.namespace == "baton:{llama-3}"
    assert keys.workers == "baton:{llama-3}:workers"
    assert keys.role("prefill") == "baton:{llama-3}:role:prefill"
    assert keys.worker("w@0a", "cached") == "baton:{llama-3}:w:w@0a:cached"


def test_models_and_prefixes_never_share_keys():
    assert Keyspace("a", "m").workers != Keyspace("b", "m").workers != Keyspace("a", "n").workers


@pytest.mark.parametrize(("prefix", "model"), [("", "m"), ("p", ""), ("p", "a{b"), ("p q", "m")])
def test_bad_parts_are_refused(prefix, model):
    with pytest.raises(ValueError, match="without whitespace or braces"):
        Keyspace(prefix, model)


def test_unknown_worker_key_part_is_refused():
    with pytest.raises(ValueError, match="unknown worker key part"):
        Keyspace("p", "m").worker("w@0", "nope")
