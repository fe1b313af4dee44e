"""An installed Baton builds its CPU kernels on first use from the csrc files its wheel ships
(kernels/cpu_ops.py), so setup.py's package data must take every one of them: a header left
out fails the build in a `pip install .` (the image) and leaves the slow torch references."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

from baton.kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def _kernels_package_data() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return ast.literal_eval(node.value)["baton.kernels"]
    raise AssertionError("setup.py has no package_data")


def test_the_wheel_ships_every_csrc_file():
    patterns = _kernels_package_data()
    csrc = ROOT / "kernels" / "csrc"
    files = [p.relative_to(ROOT / "kernels").as_posix() for p in csrc.iterdir() if p.suffix in (".cpp", ".h")]
    assert {p.name for p in cpu_ops.SOURCES} <= {Path(f).name for f in files}
    assert any(f.endswith(".h") for f in files)
    left_out = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not left_out, f"setup.py's package_data leaves out {left_out}"
