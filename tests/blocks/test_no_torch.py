"""The bookkeeping layer (hf_pagedkv/blocks) imports no torch: every one of its modules loads in a fresh interpreter
where torch and transformers cannot be imported."""

import json
import pkgutil
import subprocess
import sys

import pytest

from tests.blocks.no_torch import BLOCKED, ROOT

pytestmark = pytest.mark.bookkeeping

MODULES = sorted(f"hf_pagedkv.blocks.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "hf_pagedkv" / "blocks")]))

PROGRAM = """
import importlib, json, sys
sys.path.insert(0, {root!r})
from tests.blocks.no_torch import isolate
isolate()
for name in {modules!r}:
    importlib.import_module(name)
try:
    import torch  # noqa: F401
    blocked = False
except ImportError:
    blocked = True
print(json.dumps({{"blocked": blocked, "loaded": sorted(n for n, m in sys.modules.items() if m is not None
                                                     and n.split(".")[0] in ("hf_pagedkv",) + {heavy!r})}}))
"""


def test_every_blocks_module_imports_without_torch():
    assert "hf_pagedkv.blocks.block_allocator" in MODULES and "hf_pagedkv.blocks.prefix_index" in MODULES
    program = PROGRAM.format(root=str(ROOT), modules=MODULES, heavy=BLOCKED + ("numpy",))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr  # (an import of torch in a blocks module fails here, naming it)
    result = json.loads(out.stdout)
    assert result["blocked"]  # the check itself: torch really was out of reach
    loaded = set(result["loaded"])
    assert set(MODULES) <= loaded
    # nothing above the bottom of the package: the blocks, and the torch-free base module they size budgets with
    assert loaded - set(MODULES) == {"hf_pagedkv", "hf_pagedkv.blocks", "hf_pagedkv.config", "hf_pagedkv.errors"}
