"""The pool is a face over layer groups that own their blocks: `BlockPool` shows its users only what they call,
code outside `hf_pagedkv/pool/` reaches a group's allocator, store or prefix index only through the group's own
methods, and no class of `pool/` grows past the size the style guide gives (about 300-400 lines).

The last two checks read the source with `ast`, so they see every access, lazy or not.
"""

from __future__ import annotations

import ast
import inspect
from collections import Counter
from pathlib import Path

import pytest

from hf_pagedkv import BlockPool

ROOT = Path(__file__).resolve().parents[2] / "hf_pagedkv"
POOL = ROOT / "pool"
GROUP_INTERNALS = ("allocator", "store", "prefix_index")
MAX_CLASS_LINES = 400

# the face: what README.md and docs/*.md call on a pool, and nothing that only its collaborators call (they use
# `pool.groups[g]`, `pool.owners`, `pool.layers`, or the pool's underscored operations that need all of it)
FACE_METHODS = {
    "stats", "health", "check_invariants", "compact", "shrink", "save_prefix_cache", "load_prefix_cache", "group_for",
    "owner_busy", "idle_owners",
}
FACE_PROPERTIES = {"debug", "prefix_caching", "num_blocks", "num_used_blocks"}

# Accesses of a group's internals allowed outside pool/, as (file, attribute) -> count: none.
PENDING: dict[tuple[str, str], int] = {}


def test_block_pool_public_methods_are_exactly_the_face():
    own = {name: inspect.getattr_static(BlockPool, name) for name in vars(BlockPool) if not name.startswith("_")}
    properties = {name for name, value in own.items() if isinstance(value, property)}
    # functions, and descriptors that bind as one (`load_prefix_cache`, callable on the class or a pool)
    methods = {name for name, value in own.items() if name not in properties and hasattr(value, "__get__")}
    assert set(own) == methods | properties  # no public class attribute besides
    assert methods == FACE_METHODS
    assert properties == FACE_PROPERTIES
    # nothing public comes from elsewhere (BlockPool has no base class but object)
    assert BlockPool.__bases__ == (object,)
    # the collaborators' parts are there, and the removed delegates are gone for good
    pool = BlockPool(block_size=4)
    assert pool.owners.groups is pool.groups and pool.layers.groups is pool.groups
    for gone in ("allocate", "free", "reserve", "incref", "register_owner", "allocator", "store", "prefix_index"):
        assert not hasattr(pool, gone), gone


def _group_subscript(node: ast.AST) -> bool:
    """Whether `node` is ``<anything>.groups[<index>]``."""
    return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "groups")


def group_internal_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, attribute)`` of each ``X.groups[i].allocator`` / ``.store`` / ``.prefix_index``, and of each such
    attribute read on a name bound (in the same function) to ``X.groups[i]`` (``group = pool.groups[g]``, or one
    target of a tuple assignment)."""
    out = [(node.lineno, node.attr) for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and node.attr in GROUP_INTERNALS and _group_subscript(node.value)]
    for scope in ast.walk(tree):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        bound = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts)
                    else:
                        pairs.append((target, node.value))
                bound |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _group_subscript(v)}
        out += [(node.lineno, node.attr) for node in ast.walk(scope)
                if isinstance(node, ast.Attribute) and node.attr in GROUP_INTERNALS
                and isinstance(node.value, ast.Name) and node.value.id in bound]
    return sorted(set(out))


def test_the_walk_finds_direct_and_named_reach_throughs():
    tree = ast.parse(
        "def f(pool, g):\n"
        "    a = pool.groups[g].allocator.refcount(0)\n"  # direct
        "    group = pool.groups[g]\n"
        "    b = group.store.read(0, None)\n"  # through a name bound to a group
        "    other, n = pool.groups[g], 3\n"
        "    c = other.prefix_index\n"  # through one target of a tuple assignment
        "    d = pool.groups[g].refcount(0)\n"  # a group method: fine
        "    e = pool.allocator\n"  # the pool's own alias of group 0: not a reach-through
    )
    assert group_internal_accesses(tree) == [(2, "allocator"), (4, "store"), (6, "prefix_index")]


def test_no_module_outside_pool_reaches_into_a_layer_group():
    found: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], list[int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if POOL in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for line, attr in group_internal_accesses(ast.parse(path.read_text(encoding="utf-8"))):
            found[rel, attr] += 1
            where.setdefault((rel, attr), []).append(line)
    unexpected = {k: where[k] for k, n in found.items() if n > PENDING.get(k, 0)}
    assert not unexpected, (f"a layer group's allocator/store/prefix_index reached from outside hf_pagedkv/pool "
                            f"(file, attribute): lines {unexpected}; add a method to BlockGroup instead")
    stale = {k: (n, found.get(k, 0)) for k, n in PENDING.items() if found.get(k, 0) < n}
    assert not stale, f"PENDING lists accesses that are gone (listed, found): {stale}; lower or remove them"


@pytest.mark.parametrize("path", sorted(POOL.glob("*.py")), ids=lambda p: p.name)
def test_no_class_in_pool_is_over_the_size_limit(path):
    sizes = {node.name: node.end_lineno - node.lineno + 1
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef)}
    too_big = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not too_big, f"{path.name}: classes over {MAX_CLASS_LINES} lines {too_big}: split out an object that owns " \
                        "its own state (STYLE.md, Layout)"
