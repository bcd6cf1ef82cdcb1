"""Both page stores satisfy one `Store` protocol, the protocol covers what the package calls on a store, and no class
of `hf_pagedkv/storage` outgrows 400 lines."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.page_store import LayerSpec, PageStore
from hf_pagedkv.storage.quantized_store import QuantizedPageStore
from hf_pagedkv.storage.store import CodeStore, FullPrecisionStore, Store

PACKAGE = Path(__file__).resolve().parents[2] / "hf_pagedkv"
MAX_CLASS_LINES = 400


def members(protocol: type) -> set[str]:
    """The public names `protocol` declares itself (methods, properties, annotated attributes)."""
    own = set(vars(protocol)) | set(vars(protocol).get("__annotations__", {}))
    return {name for name in own if not name.startswith("_")}


def stores() -> list:
    spec = LayerSpec(2, 16, 16, torch.float32, torch.device("cpu"))
    fp, q = PageStore(block_size=8), QuantizedPageStore(8, QuantConfig(key_bits=8, value_bits=4))
    for store in (fp, q):
        store.add_layer(0, spec)
        store.grow(4)
    return [fp, q]


def test_both_stores_are_stores_and_each_is_its_own_kind():
    fp, q = stores()
    assert isinstance(fp, Store) and isinstance(q, Store)
    assert isinstance(fp, FullPrecisionStore) and not isinstance(fp, CodeStore)
    assert isinstance(q, CodeStore) and not isinstance(q, FullPrecisionStore)
    assert (fp.is_quantized, q.is_quantized) == (False, True)
    assert not isinstance(object(), Store)  # (the check looks at members: it is not vacuous)


@pytest.mark.parametrize("cls, protocols", [(PageStore, (Store, FullPrecisionStore)),
                                             (QuantizedPageStore, (Store, CodeStore))])
def test_every_protocol_method_has_the_protocols_parameters(cls, protocols):
    checked = []
    for protocol in protocols:
        for name in sorted(members(protocol)):
            declared = vars(protocol).get(name)
            if not inspect.isfunction(declared):
                continue  # attributes and properties: checked by isinstance on instances
            want = [(p.name, p.kind, p.default) for p in inspect.signature(declared).parameters.values()]
            got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]
            assert got == want, f"{cls.__name__}.{name} has not the parameters of {protocol.__name__}.{name}"
            checked.append(name)
    assert {"write", "read", "prepare_write", "export_blocks", "import_blocks", "grow", "shrink"} <= set(checked)


def store_calls() -> set[str]:
    """Every attribute the package reads on a page store outside `storage/`: ``<expr>.store.<name>`` anywhere, and
    ``store.<name>`` where a local `store` is a page store (everywhere but the host tiers, whose `store` is a
    `HostStore`)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "storage":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if isinstance(owner, ast.Attribute) and owner.attr == "store":
                names.add(node.attr)
            elif isinstance(owner, ast.Name) and owner.id == "store" and path.name != "host_tiers.py":
                names.add(node.attr)
    return names


def test_the_protocol_declares_every_call_the_package_makes_on_a_store():
    calls = store_calls()
    # the scan finds the calls of the pool, the adapter, the host tier, prefix files and attention
    assert {"write", "read", "prepare_write", "export_blocks", "import_blocks", "grow", "shrink", "copy_blocks",
            "release", "specs", "is_quantized", "segment_blocks", "keys", "read_codes", "layer_table"} <= calls
    declared = members(Store) | members(FullPrecisionStore) | members(CodeStore)
    assert calls - declared == set()


def test_no_class_in_storage_is_over_400_lines():
    sizes = {}
    for path in sorted((PACKAGE / "storage").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(PACKAGE)}::{node.name}"] = node.end_lineno - node.lineno + 1
    assert "storage/quantized_store.py::QuantizedPageStore" in sizes and len(sizes) > 10
    assert {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES} == {}
