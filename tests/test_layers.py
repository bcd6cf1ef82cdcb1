"""The package's folders are its layers: every intra-package import runs down (or stays in its folder), never up.

The walk reads each module's source with `ast`, so it sees every import: top-level ones, lazy ones inside
functions, and type-only ones under ``if TYPE_CHECKING:`` (a type-only import that runs up is still a circle in the
design, even though Python never executes it).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = "hf_pagedkv"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# The layer order, bottom first: a module may import its own layer and any layer below it. This table and the one
# in docs/design.md ("Module map") are the same; change both together.
LAYERS: tuple[tuple[str, str], ...] = (
    # base utilities, importable by every layer; they import only each other
    ("base", "hf_pagedkv.errors hf_pagedkv.config hf_pagedkv._compat"),
    # bookkeeping: block ids, refcounts, tables, prefix index, budgets, compaction plans; no torch
    ("bookkeeping", "hf_pagedkv.blocks"),
    # tensors: page stores, codecs, host store, prefix files
    ("storage", "hf_pagedkv.storage"),
    # events, metrics, alerts: the pool owns them, and they see a pool only through their own protocol
    ("observe", "hf_pagedkv.observe"),
    # BlockPool, the face over the layer groups; host tiers, persistence, idle shrink, the model fingerprint
    ("pool", "hf_pagedkv.pool"),
    # the "hf_pagedkv" attention function, its paged view, query recorders, kernels
    ("attention", "hf_pagedkv.attention"),
    # pure retention policies: scoring only
    ("retention", "hf_pagedkv.retention"),
    # the transformers adapter: PagedCache, PagedLayer, step planning, prefix attach/publish, offload, eviction
    ("adapter", "hf_pagedkv.adapter"),
    # the continuous-batching engine and the HTTP server
    ("serving", "hf_pagedkv.serving"),
    # CLI, planner, tuner, demo model loading
    ("tools", "hf_pagedkv.tools"),
    # the package's public face (hf_pagedkv/__init__.py): re-exports only; nothing in the package imports it
    ("face", "hf_pagedkv"),
)
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}
NO_TORCH_LAYERS = ("bookkeeping",)

# Imports allowed to run up the layer order, as (importer, imported module): none. Keep it empty; a new entry needs
# a reason written next to it.
KNOWN_UPWARD: tuple[tuple[str, str], ...] = ()

# Top-level packages of the repository that sit outside hf_pagedkv. Only the top layer (tools) may reach one, and only
# lazily inside a function: `hf-pagedkv eval` imports the repository's eval/ when run from a checkout, and says what
# to do when it is absent; nothing at module level may need it.
OUTSIDE_PACKAGES = ("eval", "benchmarks", "examples", "tests", "scripts")
LAZY_OUTSIDE_ALLOWED = ("tools",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of `module`: its longest prefix named in `LAYERS` (the face is `hf_pagedkv/__init__.py` alone)."""
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes.split():
            hit = module == prefix or name != "face" and module.startswith(prefix + ".")
            if hit and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: put it in a layer folder or name it in LAYERS")
    return best


class Import:
    """One import statement: who imports what, at which line, and whether it runs at module import time."""

    def __init__(self, importer: str, target: str, line: int, top_level: bool):
        self.importer, self.target, self.line, self.top_level = importer, target, line, top_level

    def __repr__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}"


def _imports_of(path: Path) -> list[Import]:
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(importer, alias.name, child.lineno, top_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.append(Import(importer, target, child.lineno, top_level))
                # `from hf_pagedkv.x import y` may name a submodule y: record it as an import of that module too
                folder = ROOT.parent.joinpath(*target.split("."))
                found.extend(Import(importer, f"{target}.{a.name}", child.lineno, top_level) for a in child.names
                             if (folder / a.name / "__init__.py").exists() or (folder / f"{a.name}.py").exists())
            visit(child, top_level and not lazy)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def _package_imports() -> list[Import]:
    return [imp for path in sorted(ROOT.rglob("*.py")) for imp in _imports_of(path)]


def _resolve(target: str) -> str:
    """The module an imported name lives in: `hf_pagedkv.attention` for ``from hf_pagedkv import attention``."""
    parts = target.split(".")
    while parts:
        candidate = ROOT.parent.joinpath(*parts)
        if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return target


IMPORTS = _package_imports()
INTERNAL = [imp for imp in IMPORTS if imp.target == PACKAGE or imp.target.startswith(PACKAGE + ".")]


def test_the_walk_sees_lazy_and_type_only_imports():
    internal = {(imp.importer, _resolve(imp.target), imp.top_level) for imp in INTERNAL}
    assert len(INTERNAL) > 200
    # a lazy import inside a function (the CLI imports retention lazily) is seen and marked lazy
    assert any(not top for _, _, top in internal)
    # a type-only import under `if TYPE_CHECKING:` is seen (observe.events types its pool argument this way)
    source = (ROOT / "observe" / "events.py").read_text()
    assert "if TYPE_CHECKING:" in source
    assert ("hf_pagedkv.observe.events", "hf_pagedkv.observe.pool_view", True) in internal


def test_every_module_is_in_a_layer():
    for path in ROOT.rglob("*.py"):
        layer_of(module_name(path))


def upward_imports() -> list[tuple[str, str, str]]:
    """Every (importer, imported module, reason) whose target lies in a higher layer than its importer."""
    bad = []
    for imp in INTERNAL:
        target = _resolve(imp.target)
        src, dst = layer_of(imp.importer), layer_of(target)
        if src == "base" and dst != "base":
            bad.append((imp.importer, target, f"{imp!r}: base utilities import only each other"))
        elif RANK[dst] > RANK[src]:
            bad.append((imp.importer, target, f"{imp!r}: {src} must not import {dst} (a higher layer)"))
    return bad


def test_no_import_runs_up_the_layers():
    found = upward_imports()
    allowed = set(KNOWN_UPWARD)
    new = [reason for importer, target, reason in found if (importer, target) not in allowed]
    assert not new, "imports that run up the layer order:\n" + "\n".join(new)


def test_the_known_upward_imports_are_still_there():
    # a fixed one must leave the list, so the list only shrinks
    still = {(importer, target) for importer, target, _ in upward_imports()}
    gone = [pair for pair in KNOWN_UPWARD if pair not in still]
    assert not gone, f"these are fixed: remove them from KNOWN_UPWARD: {gone}"


def _folder(module: str) -> str:
    path = ROOT.parent.joinpath(*module.split("."))
    return module if (path / "__init__.py").exists() else module.rpartition(".")[0]


def test_no_circle_between_folders():
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in INTERNAL:
        src, dst = _folder(imp.importer), _folder(_resolve(imp.target))
        if src != dst and dst != PACKAGE and (imp.importer, _resolve(imp.target)) not in set(KNOWN_UPWARD):
            graph[src].add(dst)
    state: dict[str, int] = {}
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt]
                pytest.fail("import circle between folders: " + " -> ".join(circle))
            if nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(list(graph)):
        if node not in state:
            walk(node)


def test_bookkeeping_imports_no_torch():
    for imp in IMPORTS:
        if layer_of(imp.importer) in NO_TORCH_LAYERS:
            assert imp.target.split(".")[0] not in ("torch", "numpy", "transformers"), (
                f"{imp!r}: the bookkeeping layer holds no tensors")


def test_the_package_needs_nothing_outside_it_at_import_time():
    for imp in IMPORTS:
        top = imp.target.split(".")[0]
        if top not in OUTSIDE_PACKAGES:
            continue
        assert layer_of(imp.importer) in LAZY_OUTSIDE_ALLOWED and not imp.top_level, (
            f"{imp!r}: the package must not import the repository's {top}/ (only tools may, lazily in a function)")


def test_docs_module_map_has_the_same_layers():
    # docs/design.md's module map: one row per layer, bottom first, layer name in the first column
    text = (ROOT.parent / "docs" / "design.md").read_text()
    section = text[text.index("## Module map"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")]
    assert rows[0] == "layer (bottom first)"
    assert rows[2:] == [name for name, _ in LAYERS]  # rows[1] is the `| --- |` rule
