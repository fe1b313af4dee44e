"""The examples run, bounded: examples/rl_rollout.py against a real `baton serve`
(disaggregated, local Ray and Redis) with a real gloo group between it and the trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.ray


def test_rl_rollout_updates_weights_between_rollouts():
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rl_rollout.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("logprobs within" in line for line in steps), done.stdout
    firsts = [line.split("(first sample ")[1].split(")")[0] for line in steps]
    assert firsts[0] != firsts[1]  # new weights and a new seed sample other tokens
    assert "greedy tokens after 2 updates equal the trainer's model's (step-2)" in done.stdout
