"""Renamed engine config keys still load, with a warning that names the new key."""

from __future__ import annotations

import pytest
from baton.services.engine.config import EngineConfig, ParallelConfig


def test_worker_timeout_s_is_read_as_rank_timeout_s():
    with pytest.warns(FutureWarning, match="write rank_timeout_s"):
        assert ParallelConfig(worker_timeout_s=7).rank_timeout_s == 7
    with pytest.warns(FutureWarning, match="write rank_timeout_s"):
        assert EngineConfig.from_kwargs(model="m", worker_timeout_s=9).parallel.rank_timeout_s == 9
    assert ParallelConfig(rank_timeout_s=5).rank_timeout_s == 5
