"""Maps the fixed top-level folders onto one `baton` namespace.

`services/` -> `baton.services`, `kernels/` -> `baton.kernels`, and the generated gRPC
code in `protos/baton/v1/` -> `baton.v1` (the proto package name). A top-level `kernels`
import name would shadow Hugging Face's `kernels` package, which transformers probes.

The build generates the gRPC code from protos/baton/v1/inference.proto (`build_py` runs
`baton.v1.generate()` before copying the modules; `pip install -e .` runs it too), so
`pip install .` ships it and nothing generated is committed.

One C extension: the block-hash chain (services/engine/core/_block_hash.c, against OpenSSL's
libcrypto). It is optional: where it cannot be built, block_hash.py hashes in Python.
"""

import importlib.util

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

FOLDERS = {"baton.services": "services", "baton.kernels": "kernels", "baton.v1": "protos/baton/v1"}


def _packages() -> list[str]:
    names = []
    for package, folder in FOLDERS.items():
        names.append(package)
        names.extend(f"{package}.{sub}" for sub in find_packages(folder))
    return names


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        # By file path: the package is not importable yet while it is being built.
        spec = importlib.util.spec_from_file_location("_baton_v1_build", "protos/baton/v1/__init__.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate()
        super().run()


setup(
    cmdclass={"build_py": BuildPyWithProtos},
    packages=_packages(),
    package_dir=FOLDERS,
    package_data={
        "baton.v1": ["*.proto", "*.protoset", "*.pyi"],
        "baton.services": ["**/*.jinja", "**/*.json"],
        "baton.kernels": ["csrc/*.cpp", "csrc/*.h"],  # the headers too: the kernels build on first use
    },
    ext_modules=[
        Extension(
            "baton.services.engine.core._block_hash",
            ["services/engine/core/_block_hash.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ],
)
