"""The handover's side is a Role; the names of an older release still load, with a warning."""

from __future__ import annotations

import pytest
from baton.services.kv_transfer.config import KVTransferConfig
from baton.services.roles import Role


def test_the_role_is_colocated_unless_set():
    assert KVTransferConfig().role is Role.COLOCATED
    assert KVTransferConfig(role="prefill").role is Role.PREFILL


@pytest.mark.parametrize(
    ("old", "new"), [("none", Role.COLOCATED), ("producer", Role.PREFILL), ("consumer", Role.DECODE)]
)
def test_an_old_role_name_loads_and_the_warning_names_the_new_one(old, new):
    with pytest.warns(FutureWarning, match=f"'{old}' is deprecated: write '{new.value}'"):
        assert KVTransferConfig(role=old).role is new


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        KVTransferConfig(role="both")
