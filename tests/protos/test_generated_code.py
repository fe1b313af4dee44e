"""baton.v1's generated code: made by the build, never at import. Without it, importing it
fails with an error that names the fix; `generate()` (what `make protos` and setup.py call)
then makes it importable in the same process."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

PROTOS = Path(__file__).resolve().parents[2] / "protos" / "baton" / "v1"


def _run(root: Path, code: str) -> subprocess.CompletedProcess:
    # -S: no .pth files, so the editable install's finder cannot reach the repository's copy.
    env = {"PYTHONPATH": f"{root}:{':'.join(site.getsitepackages())}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_missing_code_names_the_fix_and_generate_makes_it(tmp_path):
    package = tmp_path / "baton" / "v1"
    package.mkdir(parents=True)
    for name in ("__init__.py", "inference.proto"):
        shutil.copy(PROTOS / name, package / name)
    for code in ("from baton.v1 import inference_pb2", "import baton.v1.inference_pb2_grpc"):
        failed = _run(tmp_path, code)
        assert failed.returncode != 0
        assert "baton.v1's generated code is missing" in failed.stderr and "make protos" in failed.stderr
    assert not (package / "inference_pb2.py").exists()  # importing generated nothing
    made = _run(
        tmp_path,
        "import baton.v1; baton.v1.generate(); from baton.v1 import inference_pb2_grpc, inference_pb2;"
        "print(inference_pb2.GenerateRequest.DESCRIPTOR.full_name)",
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "baton.v1.GenerateRequest"
    assert (package / "inference.protoset").stat().st_size > 0
