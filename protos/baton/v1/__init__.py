"""Generated gRPC code for the `baton.v1` API (import as `baton.v1`).

`inference.proto` is compiled in the build, never at import time: `pip install .` (setup.py's
build step) and `make protos` both call `generate()`, which runs grpcio-tools' protoc and
writes `inference_pb2.py`, `inference_pb2_grpc.py`, `inference_pb2.pyi` and the descriptor
set `inference.protoset` next to the .proto (none of them is committed). Where they are
missing, importing them fails with an error that names the fix.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTO = _HERE / "inference.proto"
_OUTPUTS = ("inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi", "inference.protoset")
DESCRIPTOR_SET = _HERE / "inference.protoset"  # for generic clients: grpcurl -protoset, dynamic stubs
MISSING_MESSAGE = (
    "baton.v1's generated code is missing ({name}): run `make protos` in the repository, or "
    "reinstall Baton with `pip install .`, which generates it from protos/baton/v1/inference.proto"
)


def generate(force: bool = False) -> None:
    """Compiles inference.proto next to itself (if any output is missing or older than it).

    The outputs are written to a temporary folder first and moved in one by one, so a
    concurrent reader never sees half a file."""
    if not force and all(_fresh(_HERE / name) for name in _OUTPUTS):
        return
    from grpc_tools import protoc

    proto_root = _HERE.parents[1]  # protos/
    with tempfile.TemporaryDirectory(dir=_HERE) as tmp:
        out = Path(tmp) / "baton" / "v1"
        out.mkdir(parents=True)
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--descriptor_set_out={out / 'inference.protoset'}",
            "--include_imports",
            "--include_source_info",
            str(_PROTO.relative_to(proto_root)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {_PROTO}")
        for name in _OUTPUTS:
            os.replace(out / name, _HERE / name)
    importlib.invalidate_caches()  # this process may have looked for the modules already


def _fresh(path: Path) -> bool:
    return path.exists() and path.stat().st_mtime >= _PROTO.stat().st_mtime


class _MissingGeneratedCode(importlib.abc.MetaPathFinder):
    """Consulted after every other finder: a generated module that none of them found was not
    generated. Covers every way of importing it (`from baton.v1 import inference_pb2`, and
    the dotted paths Serve imports its gRPC servicers by)."""

    MODULES = frozenset(f"{__name__}.{name.removesuffix('.py')}" for name in _OUTPUTS if name.endswith(".py"))

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.MODULES:
            # ImportError, not ModuleNotFoundError: `from baton.v1 import x` would swallow that
            # one and raise a bare "cannot import name" instead of this message.
            raise ImportError(MISSING_MESSAGE.format(name=fullname), name=fullname)
        return None


if not any(isinstance(finder, _MissingGeneratedCode) for finder in sys.meta_path):
    sys.meta_path.append(_MissingGeneratedCode())
