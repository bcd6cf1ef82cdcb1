"""The bookkeeping lane: the pure-Python tests of hf_pagedkv/blocks (tests/blocks, marker `bookkeeping`) with torch
and transformers blocked, in seconds. `bash scripts/test.sh --fast` runs it; extra arguments go to pytest.

The shared fixtures of tests/conftest.py build models (torch), so they are not loaded here (`--noconftest`).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.blocks.no_torch import isolate  # noqa: E402

isolate()

import pytest  # noqa: E402

sys.exit(pytest.main(["--noconftest", "-p", "no:cacheprovider", "-m", "bookkeeping", str(ROOT / "tests" / "blocks"),
                      *sys.argv[1:]]))
