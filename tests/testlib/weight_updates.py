"""Helpers for the weight-update tests (tests/services/engine/weight_updates): Hugging Face
parity on the new weights, and a real trainer process (weight_trainer.py) broadcasting
over a gloo group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testlib.hf import hf_greedy

TRAINER = Path(__file__).with_name("weight_trainer.py")
PROMPTS = ["def foo(x):", "The quick brown fox jumps over the lazy dog because", "import os\nimport sys\n" * 3, "A"]
MAX_TOKENS = 12


def assert_equals_hf(model_dir: Path, prompt_ids: list[list[int]], outputs, max_tokens: int = MAX_TOKENS) -> None:
    """Greedy tokens equal HF's on `model_dir`; each sampled token's logprob within 1e-3."""
    for ids, out in zip(prompt_ids, outputs, strict=True):
        tokens, logprobs = hf_greedy(model_dir, ids, max_tokens)
        assert out.token_ids == tokens
        if out.logprobs is not None:
            for token, entry, ref in zip(out.token_ids, out.logprobs, logprobs, strict=True):
                assert entry[token].logprob == pytest.approx(ref, abs=1e-3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """A real trainer process (trainer_process.py): rank 0 of a gloo group, it takes a
    gradient step on `model_dir`, saves the result to `out_dir`, then broadcasts it."""

    def __init__(
        self,
        model_dir: Path,
        out_dir: Path,
        world_size: int,
        bucket_bytes: int,
        die_after: int | None = None,
        flat: bool = False,
    ) -> None:
        self.port = free_port()
        self.out_dir = out_dir
        self.world_size = world_size
        args = [str(model_dir), str(out_dir), str(self.port), str(world_size), str(bucket_bytes)]
        args += [] if die_after is None else [str(die_after)]
        env = {**os.environ, "BATON_TRAINER_FLAT": "1" if flat else "0"}
        self.process = subprocess.Popen([sys.executable, str(TRAINER), *args], env=env)

    def metadata(self, timeout_s: float = 120.0) -> dict:
        """names, dtypes and shapes, once the trainer has its new weights."""
        path = self.out_dir / "update.json"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            assert self.process.poll() is None, f"the trainer exited with {self.process.returncode}"
            assert time.monotonic() < deadline, "the trainer did not get ready"
            time.sleep(0.05)
        return json.loads(path.read_text())

    def join(self, returncode: int = 0) -> None:
        assert self.process.wait(timeout=120) == returncode
