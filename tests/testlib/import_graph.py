"""The import graph of a source tree, read with `ast` (nothing is imported): which module
imports which, for the layering tests (tests/services/test_layering.py).

Modules are named relative to the tree's root: `router.worker_info` for
router/worker_info.py, `router` for router/__init__.py, "" for the root's __init__.py.
Every import statement counts, wherever it stands: at module level, inside a function,
or under `if TYPE_CHECKING:`. A deferred import only moves the cost to later; the module
still needs the other one to run, or to be checked.

An import names its target as precisely as it can: `from . import lua_scripts` is an
edge to the module `router.lua_scripts`, `from .config import RouterConfig` one to
`router.config`, `from .. import metrics` one to `metrics`. A target with no source file
in the tree (a compiled extension such as engine.core._block_hash, built or not) keeps its
name. Imports from outside the tree (the standard library, torch, `baton.kernels`) are
left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (or package)
    line: int
    path: Path  # the importing file, from the tree's parent on (services/router/router.py)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source or '<root>'} imports {self.target or '<root>'}"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the tree by name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(root: Path, absolute_prefix: str) -> list[Import]:
    """Every import between modules of the tree. `absolute_prefix` is the tree's own import
    name ("baton.services"), so that absolute imports of it count as well as relative ones."""
    modules = module_names(root)
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        shown = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = dict.fromkeys(_targets(node, package, absolute_prefix, modules, path))  # once per statement
            found.extend(Import(name, target, node.lineno, shown) for target in targets)
    return found


def _targets(node: ast.AST, package: str, prefix: str, modules: dict[str, Path], path: Path) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            inside = _inside(alias.name, prefix)
            if inside is not None:
                yield inside
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package.split(".") if package else []
            if node.level - 1 > len(parts):
                raise ValueError(f"{path}:{node.lineno}: a relative import reaches above the tree's root")
            base = ".".join([*parts[: len(parts) - (node.level - 1)], *([node.module] if node.module else [])])
        else:
            base = _inside(node.module or "", prefix)
            if base is None:
                return
        for alias in node.names:
            submodule = f"{base}.{alias.name}" if base else alias.name
            yield submodule if submodule in modules else base


def _inside(module: str, prefix: str) -> str | None:
    """The name within the tree of an absolute module name; None for one outside it."""
    if module == prefix:
        return ""
    return module[len(prefix) + 1 :] if module.startswith(prefix + ".") else None


def find_cycle(edges: list[Import]) -> list[Import] | None:
    """One import cycle between modules (each import's target is the next one's source), or None."""
    graph: dict[str, list[Import]] = {}
    for edge in edges:
        if edge.source != edge.target:
            graph.setdefault(edge.source, []).append(edge)
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        # Depth first, without recursion: the path holds the imports walked from `start`.
        path: list[Import] = []
        on_path = {start}
        pending = [iter(graph.get(start, []))]
        while pending:
            edge = next(pending[-1], None)
            if edge is None:
                pending.pop()
                finished = path.pop().target if path else start
                on_path.discard(finished)
                done.add(finished)
                continue
            if edge.target in on_path:
                first = next((i for i, e in enumerate(path) if e.source == edge.target), len(path))
                return [*path[first:], edge]
            if edge.target not in done:
                path.append(edge)
                on_path.add(edge.target)
                pending.append(iter(graph.get(edge.target, [])))
    return None


def top_level(module: str) -> str:
    """The top-level package (or module) a module belongs to; "__init__" for the root's."""
    return module.partition(".")[0] or "__init__"
