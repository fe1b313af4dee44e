"""Generated gRPC code for the `baton.v1` API (import as `baton.v1`).

`inference.proto` is compiled at set-up time (`make protos`). If the generated modules are
missing or older than the .proto (a fresh checkout, an edited API), they are generated on
first import, with grpcio-tools, atomically, so concurrent processes cannot see half a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTO = _HERE / "inference.proto"
_OUTPUTS = ("inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi", "inference.protoset")
DESCRIPTOR_SET = _HERE / "inference.protoset"  # for generic clients: grpcurl -protoset, dynamic stubs


def generate(force: bool = False) -> None:
    """Compiles inference.proto next to itself (if needed)."""
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


def _fresh(path: Path) -> bool:
    return path.exists() and path.stat().st_mtime >= _PROTO.stat().st_mtime


generate()
