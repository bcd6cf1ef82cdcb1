"""Load `hf_pagedkv.blocks` with torch out of reach: what the bookkeeping lane (`bash scripts/test.sh --fast`) and
`test_no_torch.py` run under."""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: imports that fail under `isolate` (an import of a name set to None in `sys.modules` raises ImportError)
BLOCKED = ("torch", "transformers")


def isolate() -> None:
    """Block `BLOCKED` and put a bare `hf_pagedkv` package in place of the real one, whose `__init__` imports the
    whole package (torch included): ``import hf_pagedkv.blocks.X`` then runs only the code `X` itself imports."""
    for name in BLOCKED:
        sys.modules[name] = None
    package = types.ModuleType("hf_pagedkv")
    package.__path__ = [str(ROOT / "hf_pagedkv")]
    sys.modules["hf_pagedkv"] = package
