"""Each copy of Baton's kernel sources builds into a folder of its own in torch's extension
cache (kernels/cpu_ops.py `library_name`), so a CI clone beside a working tree with other
sources does not rebuild over the working tree's library, or load it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from baton.kernels import cpu_ops


def test_each_copy_of_the_sources_has_a_folder_of_its_own(tmp_path):
    csrc = cpu_ops.SOURCES[0].parent
    here = cpu_ops.library_name("baton_cpu_kernels")
    assert here.startswith("baton_cpu_kernels_") and here == cpu_ops.library_name("baton_cpu_kernels", csrc)
    copy = Path(shutil.copytree(csrc, tmp_path / "csrc"))
    assert cpu_ops.library_name("baton_cpu_kernels", copy) != here


@pytest.mark.skipif(not cpu_ops.available(), reason="Baton's CPU kernels cannot be built here")
def test_the_library_is_built_in_this_copys_folder():
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(cpu_ops.library_name("baton_cpu_kernels"), verbose=False))
    assert any(folder.glob("*.so")), sorted(folder.iterdir())
