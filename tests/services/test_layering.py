"""The services' layers: no import cycle between modules, and no package imports one above it.

The layers, bottom to top (a package imports only from its own files and from lower layers;
packages that share a layer stay independent of each other):

    roles, ray_env, metrics, local_channel, the root __init__   leaves: import nothing of services
    model                  the model's layers and its loader
    kv_transfer            the KV handover's transports
    engine                 scheduler, KV cache, model runner; LLM and AsyncLLM
    serving_errors, worker_calls, autoscaling   how serving maps engine errors; what the gateway
                           sends workers; what replicas report to Serve's autoscaler and its policy
    router                 the prefix-aware router (its Serve request router reads worker calls)
    workers                the engine worker replica (registers with the router)
    gateway                gRPC and OpenAI HTTP in front of the workers
    disaggregation         prefill then decode, through the gateway's EngineClient
    config, loadtest, client   the service config; baton bench; the gRPC client
    serve_app              the Ray Serve application
    launcher               baton serve on one machine
    cli                    the baton command

Every import counts, at module level, in a function or under TYPE_CHECKING
(testlib/import_graph.py says why). The graph is read from the source, so a module that
cannot be imported here (Ray, NIXL) is checked all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testlib.import_graph import Import, find_cycle, imports, module_names, top_level

SERVICES = Path(__file__).resolve().parents[2] / "services"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "roles", "ray_env", "replica_ports", "metrics", "client_tls", "local_channel"),
    ("model",),
    ("kv_transfer",),
    ("engine",),
    ("serving_errors", "worker_calls", "autoscaling"),
    ("router",),
    ("workers",),
    ("gateway",),
    ("disaggregation",),
    ("config", "loadtest", "client"),
    ("serve_app",),
    ("launcher",),
    ("cli",),
)


def describe(layers: tuple[tuple[str, ...], ...]) -> str:
    return " < ".join(", ".join(members) for members in layers)


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {package: rank for rank, members in enumerate(layers) for package in members}


def upward_imports(edges: list[Import], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Each import of a package from one in its own layer or above, as a readable line."""
    rank = layer_of(layers)
    found = []
    for edge in edges:
        source, target = top_level(edge.source), top_level(edge.target)
        if source != target and rank[target] >= rank[source]:
            where = "the same layer as" if rank[target] == rank[source] else "a higher layer than"
            found.append(f"{edge}: {target} is in {where} {source}")
    return found


def unlisted_packages(root: Path, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    return sorted({top_level(name) for name in module_names(root)} - set(layer_of(layers)))


@pytest.fixture(scope="module")
def edges() -> list[Import]:
    return imports(SERVICES, "baton.services")


def test_every_top_level_package_has_a_layer():
    unlisted = unlisted_packages(SERVICES, LAYERS)
    assert not unlisted, (
        f"services/{unlisted} has no layer: add it to LAYERS in {Path(__file__).name}, above everything it imports "
        f"and below everything that imports it (the layers, bottom to top: {describe(LAYERS)})"
    )


def test_every_layered_package_exists():
    present = {top_level(name) for name in module_names(SERVICES)}
    gone = sorted(set(layer_of(LAYERS)) - present)
    assert not gone, f"LAYERS in {Path(__file__).name} names packages that are gone: {gone}"


def test_no_package_imports_one_above_it(edges):
    unlisted = unlisted_packages(SERVICES, LAYERS)
    if unlisted:
        pytest.fail(f"services/{unlisted} has no layer (see test_every_top_level_package_has_a_layer)")
    upward = upward_imports(edges, LAYERS)
    assert not upward, f"imports against the layers ({describe(LAYERS)}):\n" + "\n".join(upward)


def test_no_import_cycle_between_modules(edges):
    cycle = find_cycle(edges)
    assert cycle is None, "an import cycle:\n" + "\n".join(map(str, cycle))


# -- the checks themselves, on a made-up tree ------------------------------------------


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_relative_absolute_deferred_and_type_only_imports_all_count(tmp_path):
    root = make_tree(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "import os\n",
            "high/__init__.py": "from .part import x\n",
            "high/part.py": "from .. import low\nfrom pkg.low import y\n",
            "high/late.py": "def f():\n    import pkg.high.part\n",
            "high/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..low import Z\n",
        },
    )
    found = {(e.source, e.target) for e in imports(root, "pkg")}
    assert found == {
        ("high", "high.part"),
        ("high.part", "low"),
        ("high.late", "high.part"),
        ("high.typed", "low"),
    }


def test_an_import_of_a_higher_or_same_layer_is_reported(tmp_path):
    root = make_tree(
        tmp_path, {"low.py": "from .high import x\n", "high.py": "from . import side\n", "side.py": "import os\n"}
    )
    upward = upward_imports(imports(root, "pkg"), (("low",), ("high", "side")))
    assert len(upward) == 2
    assert "low imports high: high is in a higher layer than low" in upward[0] + upward[1]
    assert "high imports side: side is in the same layer as high" in upward[0] + upward[1]


def test_an_unlisted_package_is_named(tmp_path):
    root = make_tree(tmp_path, {"low.py": "", "new/__init__.py": ""})
    assert unlisted_packages(root, (("low",),)) == ["new"]


def test_an_import_cycle_is_reported_along_its_path(tmp_path):
    root = make_tree(
        tmp_path,
        {
            "a.py": "from . import b\n",
            "b.py": "def f():\n    from . import c\n",
            "c.py": "from .a import x\n",
            "d.py": "from . import a\n",
        },
    )
    cycle = find_cycle(imports(root, "pkg"))
    assert [(e.source, e.target) for e in cycle] == [("a", "b"), ("b", "c"), ("c", "a")]
    assert (
        find_cycle(imports(make_tree(tmp_path / "acyclic", {"a.py": "from . import b\n", "b.py": ""}), "pkg")) is None
    )


def test_a_compiled_module_keeps_its_name(tmp_path):
    root = make_tree(tmp_path, {"a.py": "from ._native import f\n"})
    assert [(e.source, e.target) for e in imports(root, "pkg")] == [("a", "_native")]
