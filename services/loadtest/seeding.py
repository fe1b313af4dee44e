"""Reproducibility: every random choice comes from a generator keyed by (seed, stream, keys...).

Streams keep the pieces independent, and the keys say what a draw may depend on:

    SHAPES         (seed, session)       request class, prompt and output lengths, prefix group
    TOKENS         (seed, run, session)  the token ids
    ARRIVALS       (seed)                the gaps, before scaling by 1 / rate
    PREFIX_SHAPES  (seed)                shared-prefix groups' prefix lengths
    PREFIX_TOKENS  (seed, run)           their token ids
    DATASET        (seed)                dataset sampling order

So request i is the same whatever the request count or duration; every run of a sweep
sends requests of the same shapes on the same arrival pattern (compressed by its rate),
and differs only in token ids, so a later run does not find an earlier run's prompts in
the server's prefix cache. Changing the rate does not change the prompts.
"""

from __future__ import annotations

import numpy as np

SHAPES = 1
TOKENS = 2
ARRIVALS = 3
PREFIX_SHAPES = 4
PREFIX_TOKENS = 5
DATASET = 6


def rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, *keys])
