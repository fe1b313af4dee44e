"""No module under services/ or kernels/ grows past 400 lines: past that it holds two
concepts (docs/architecture.md lists one module per concept)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def test_no_module_past_400_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("services", "kernels")
        for path in (ROOT / folder).rglob("*.py")
        if "_pb2" not in path.name
    }
    assert sizes, "no modules found"
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"split these by concept (over {MAX_LINES} lines): {too_long}"
