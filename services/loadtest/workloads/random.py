"""Random prompts: token ids drawn uniformly, lengths from distributions, one or more classes.

A class is (name, weight, prompt length, output length). One class gives the classic random
workload; several give a mix, e.g. long prompts with short replies beside short prompts with
long replies (what separates colocated from disaggregated serving). The class name is the
request's workload group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BenchInputError
from ..lengths import LengthDistribution
from .base import Session, Turn, Workload, random_token_ids


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    weight: float
    prompt_len: LengthDistribution
    output_len: LengthDistribution

    @classmethod
    def parse(cls, spec: str) -> RequestClass:
        """NAME,WEIGHT,PROMPT_LEN,OUTPUT_LEN, e.g. "long,0.3,uniform:900:1100,16"."""
        parts = spec.split(",")
        if len(parts) != 4:
            raise BenchInputError(f"request class {spec!r}: expected NAME,WEIGHT,PROMPT_LEN,OUTPUT_LEN")
        try:
            weight = float(parts[1])
        except ValueError as e:
            raise BenchInputError(f"request class {spec!r}: weight {parts[1]!r} is not a number") from e
        if not weight > 0:
            raise BenchInputError(f"request class {spec!r}: weight must be > 0")
        return cls(parts[0], weight, LengthDistribution.parse(parts[2]), LengthDistribution.parse(parts[3]))


class RandomWorkload(Workload):
    name = "random"

    def __init__(self, classes: list[RequestClass]) -> None:
        super().__init__()
        if not classes:
            raise BenchInputError("random workload: at least one request class")
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise BenchInputError(f"random workload: class names must differ, got {names}")
        self.classes = classes
        total = sum(c.weight for c in classes)
        self._probabilities = [c.weight / total for c in classes]

    def session(self, seed: int, run: int, index: int) -> Session:
        shape, tokens = self._session_rngs(seed, run, index)
        request_class = self.classes[int(shape.choice(len(self.classes), p=self._probabilities))]
        prompt_len, output_len = request_class.prompt_len.sample(shape), request_class.output_len.sample(shape)
        turn = Turn(output_len, new_token_ids=random_token_ids(tokens, prompt_len, self.vocab_size))
        return Session(request_class.name, [turn])

    def max_context_tokens(self) -> int:
        return max(c.prompt_len.high + c.output_len.high for c in self.classes)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "classes": [
                {
                    "name": c.name,
                    "weight": c.weight,
                    "prompt_len": c.prompt_len.spec(),
                    "output_len": c.output_len.spec(),
                }
                for c in self.classes
            ],
        }
