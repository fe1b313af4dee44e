"""Maps the fixed top-level folders onto one `baton` namespace.

`services/` -> `baton.services`, `kernels/` -> `baton.kernels`, and the generated gRPC
code in `protos/baton/v1/` -> `baton.v1` (the proto package name). A top-level `kernels`
import name would shadow Hugging Face's `kernels` package, which transformers probes.
"""

from setuptools import find_packages, setup

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
)
