"""The suite's conftest ends the pytest process without finalizing the interpreter
(tests/conftest.py says why); pytest's exit status and report must come through unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def run_pytest(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(body)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", *args, str(tmp_path)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("body", "args", "status", "summary"),
    [
        ("def test_ok():\n    pass\n", (), 0, "1 passed"),
        ("def test_bad():\n    assert 1 == 2\n", (), 1, "1 failed"),
        ("def test_ok():\n    pass\n", ("-k", "no_such_test"), 5, "1 deselected"),
    ],
    ids=["passed", "failed", "no-tests"],
)
def test_exit_status_and_report_survive(tmp_path, body, args, status, summary):
    result = run_pytest(tmp_path, body, *args)
    assert result.returncode == status, result.stdout + result.stderr
    assert summary in result.stdout.splitlines()[-1]
