"""The router library imports without Ray (the serving layer brings Ray, not this package)."""

from __future__ import annotations

import subprocess
import sys


def test_router_imports_without_ray():
    code = "import sys, baton.services.router; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
