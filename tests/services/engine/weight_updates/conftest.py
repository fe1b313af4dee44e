"""Two tiny models of one architecture (different seeds): the engine starts on `old_dir`
and is updated to `new_dir`; Hugging Face on `new_dir` is the reference. Llama has its own
LM head, Qwen3 ties it to the embedding (an update must keep them tied)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testlib.models import tiny_model
from testlib.weight_updates import Trainer


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def old_dir(arch) -> Path:
    return tiny_model(arch)


@pytest.fixture(scope="session")
def new_dir(arch) -> Path:
    return tiny_model(arch, seed=1)


@pytest.fixture
def trainer_factory():
    trainers: list[Trainer] = []

    def start(*args, **kwargs) -> Trainer:
        trainers.append(Trainer(*args, **kwargs))
        return trainers[-1]

    yield start
    for trainer in trainers:
        if trainer.process.poll() is None:
            trainer.process.kill()
