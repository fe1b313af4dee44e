"""Token-length distributions for synthetic prompts and outputs, parsed from short specs.

    "128"             always 128
    "uniform:64:256"  uniform integers in [64, 256]
    "normal:128:32"   normal(mean 128, std 32), rounded, clipped to [max(1, mean - 3 std), mean + 3 std]

Every distribution has a finite maximum, so a workload can prove before the load starts
that its longest request fits the server's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import BenchInputError

Kind = Literal["fixed", "uniform", "normal"]


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    kind: Kind
    low: int  # smallest value drawn
    high: int  # largest value drawn
    mean: float = 0.0  # normal only
    std: float = 0.0  # normal only

    @classmethod
    def fixed(cls, value: int) -> LengthDistribution:
        return cls.parse(str(value))

    @classmethod
    def parse(cls, spec: str | int) -> LengthDistribution:
        text = str(spec).strip()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", int(parts[0]), int(parts[0]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "normal" and len(parts) == 3:
                mean, std = float(parts[1]), float(parts[2])
                if std < 0:
                    raise BenchInputError(f"length {text!r}: std must be >= 0")
                dist = cls("normal", max(1, round(mean - 3 * std)), round(mean + 3 * std), mean, std)
            else:
                raise BenchInputError(f"length {text!r}: expected N, uniform:LOW:HIGH or normal:MEAN:STD")
        except ValueError as e:
            if isinstance(e, BenchInputError):
                raise
            raise BenchInputError(f"length {text!r}: {e}") from e
        if dist.low < 1 or dist.high < dist.low:
            raise BenchInputError(f"length {text!r}: need 1 <= low <= high, got [{dist.low}, {dist.high}]")
        return dist

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return int(rng.integers(self.low, self.high + 1))
        return int(np.clip(round(rng.normal(self.mean, self.std)), self.low, self.high))

    def spec(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform:{self.low}:{self.high}"
        return f"normal:{self.mean:g}:{self.std:g}"
