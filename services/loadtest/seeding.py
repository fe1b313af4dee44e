"""Reproducibility: every random choice comes from a generator keyed by (seed, stream, keys...).

Streams keep the pieces independent: changing the arrival rate does not change the prompts,
and request `i` of run `r` is the same request whatever the request count or duration.
Each run of a sweep gets its own prompts (the run index is a key), so a later run does not
find an earlier run's prompts in the server's prefix cache.
"""

from __future__ import annotations

import numpy as np

WORKLOAD = 1  # per-session prompt and length draws
ARRIVALS = 2  # inter-arrival gaps
PREFIXES = 3  # shared-prefix group prefixes
WARMUP = 4  # warm-up requests
DATASET = 5  # dataset sampling order


def rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, *keys])
