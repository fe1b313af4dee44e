"""Prompts from a ShareGPT-format JSON file given by path (never downloaded).

The file is a JSON list of conversations:

    [{"id": "...", "conversations": [{"from": "human", "value": "..."},
                                     {"from": "gpt", "value": "..."}, ...]}, ...]

Each usable conversation gives one request: its first human message is the prompt, and the
first reply after it sets the output length (its token count when a tokenizer is available:
the server's over gRPC, or --tokenizer; else the fixed `output_len`). Conversations whose
prompt plus output would not fit the server's context are skipped. The file is checked when
it is loaded, before any connection: a malformed file is a `BenchInputError` naming the
entry and field at fault. Each run of a sweep samples its own conversations where the file
has enough.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import seeding
from ..errors import BenchInputError
from .base import Session, Turn, Workload, WorkloadContext

_USER_ROLES = ("human", "user")
_COUNT_BATCH = 64


@dataclass(frozen=True, slots=True)
class Exchange:
    prompt: str
    reply: str


def parse_sharegpt(path: str | Path) -> list[Exchange]:
    """The (first prompt, first reply) of every conversation that has both."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BenchInputError(f"cannot read the dataset {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise BenchInputError(f"dataset {path} is not UTF-8 text: {e}") from e
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BenchInputError(f"dataset {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(data, list):
        raise BenchInputError(f"dataset {path}: expected a JSON list of conversations, got {type(data).__name__}")
    exchanges = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise BenchInputError(f'dataset {path}: entry {i} has no "conversations" list (ShareGPT format)')
        for j, turn in enumerate(turns):
            if not (
                isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)
            ):
                raise BenchInputError(
                    f'dataset {path}: entry {i}, turn {j} must be an object with string "from" and "value"'
                )
        exchange = _first_exchange(turns)
        if exchange is not None:
            exchanges.append(exchange)
    if not exchanges:
        raise BenchInputError(f"dataset {path} has no conversation with a human prompt followed by a reply")
    return exchanges


def _first_exchange(turns: list[dict[str, str]]) -> Exchange | None:
    for prompt, reply in zip(turns, turns[1:]):
        if prompt["from"] in _USER_ROLES and prompt["value"].strip() and reply["from"] not in _USER_ROLES:
            return Exchange(prompt["value"], reply["value"])
    return None


@dataclass(slots=True)
class _Prepared:
    prompt: str
    num_prompt_tokens: int | None
    max_tokens: int


class ShareGPTWorkload(Workload):
    name = "sharegpt"

    def __init__(self, path: str | Path, output_len: int | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.exchanges = parse_sharegpt(self.path)
        self.output_len = output_len  # fixed output length; None: the reply's length (needs a tokenizer)
        if output_len is not None and output_len < 1:
            raise BenchInputError(f"sharegpt workload: output length must be >= 1, got {output_len}")
        self._pool: list[_Prepared] = []
        self._per_run = 0  # sessions each run of a sweep takes from the pool before it wraps

    @property
    def uses_token_ids(self) -> bool:
        return False

    async def prepare(self, context: WorkloadContext, num_sessions: int) -> None:
        if self.output_len is None and context.count_tokens is None:
            raise BenchInputError(
                "sharegpt workload: output lengths come from the replies' token counts, and no tokenizer is "
                "available (give --tokenizer DIR, or a fixed --output-len)"
            )
        order = seeding.rng(context.seed, seeding.DATASET).permutation(len(self.exchanges))
        wanted = num_sessions * context.num_runs
        pool: list[_Prepared] = []
        for start in range(0, len(order), _COUNT_BATCH):
            batch = [self.exchanges[i] for i in order[start : start + _COUNT_BATCH]]
            pool.extend(await self._prepare_batch(batch, context))
            if len(pool) >= wanted:
                break
        if not pool:
            raise BenchInputError(
                f"sharegpt workload: no conversation in {self.path} fits the server's context "
                f"({context.max_context_length} tokens)"
            )
        self._pool = pool
        self._per_run = max(1, min(num_sessions, len(pool) // context.num_runs))

    async def _prepare_batch(self, batch: list[Exchange], context: WorkloadContext) -> list[_Prepared]:
        prompts = [e.prompt for e in batch]
        if context.count_tokens is None:
            return [_Prepared(p, None, self.output_len) for p in prompts]
        prompt_counts = await context.count_tokens(prompts, True)
        if self.output_len is None:
            outputs = [max(1, n) for n in await context.count_tokens([e.reply for e in batch], False)]
        else:
            outputs = [self.output_len] * len(batch)
        limit = context.max_context_length
        return [
            _Prepared(p, n, out)
            for p, n, out in zip(prompts, prompt_counts, outputs)
            if limit is None or n + out <= limit
        ]

    def session(self, seed: int, run: int, index: int) -> Session:
        assert self._pool, "prepare() first"
        # run r takes its own slice of the (shuffled) pool while the pool lasts, then wraps
        item = self._pool[(run * self._per_run + index % self._per_run) % len(self._pool)]
        return Session("sharegpt", [Turn(item.max_tokens, text=item.prompt, num_text_tokens=item.num_prompt_tokens)])

    def max_context_tokens(self) -> int:
        return 0  # checked per conversation in prepare()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "num_conversations": len(self.exchanges),
            "num_prepared": len(self._pool),
            "output_len": self.output_len,
        }
