"""Maps the fixed top-level folders onto one `baton` namespace.

`services/` -> `baton.services`, `kernels/` -> `baton.kernels`, and the generated gRPC
code in `protos/baton/v1/` -> `baton.v1` (the proto package name). A top-level `kernels`
import name would shadow Hugging Face's `kernels` package, which transformers probes.

One C extension: the block-hash chain (services/engine/core/_block_hash.c, against OpenSSL's
libcrypto). It is optional: where it cannot be built, block_hash.py hashes in Python.
"""

from setuptools import Extension, find_packages, setup

FOLDERS = {"baton.services": "services", "baton.kernels": "kernels", "baton.v1": "protos/baton/v1"}


def _packages() -> list[str]:
    names = []
    for package, folder in FOLDERS.items():
        names.append(package)
        names.extend(f"{package}.{sub}" for sub in find_packages(folder))
    return names


setup(
    packages=_packages(),
    package_dir=FOLDERS,
    package_data={
        "baton.v1": ["*.proto", "*.desc"],
        "baton.services": ["**/*.jinja", "**/*.json"],
        "baton.kernels": ["csrc/*.cpp"],
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
