"""`hf-pagedkv --help`, a subcommand's --help and an argument error answer without importing torch or
transformers (seconds of imports); a library `import hf_pagedkv` loads the face at once and registers the
"hf_pagedkv" attention."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "fastapi", "uvicorn")

# runs `hf-pagedkv ARGV` as the console script does, then prints its exit status and the heavy modules it imported
_RUN = """
import json, sys
from hf_pagedkv_cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps([code, sorted(m for m in {heavy} if m in sys.modules)]), file=sys.stderr)
"""


def _run(argv: list[str]) -> tuple[int, list[str], str, str]:
    out = subprocess.run([sys.executable, "-c", _RUN.format(heavy=HEAVY), *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    *lines, last = out.stderr.rstrip("\n").split("\n")
    code, heavy = json.loads(last)
    return code, heavy, out.stdout, "\n".join(lines)


@pytest.mark.parametrize("argv, code, shown", [
    (["--help"], 0, "{eval,generate,plan,tune-block-size,trace,serve}"),
    (["serve", "--help"], 0, "--max-batch-tokens"),
    (["generate", "--help"], 0, "--max-new-tokens"),
    (["plan", "--help"], 0, "--max-seq-len"),
    (["serve", "--port", "70000"], 2, "--port must be <= 65535, got 70000"),
    (["serve", "--max-memory", "lots"], 2, "--max-memory: `--max-memory`"),
    (["serve", "--prefix-cache-file", "/no/such/folder/p.safetensors"], 2, "is not a writable directory"),
    (["generate", "--max-new-tokens", "0"], 2, "--max-new-tokens must be positive, got 0"),
    (["serve", "--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    (["generate", "--quant", "k4v4x"], 2, "'k4v4x' is not a KV format; give the ladder fp, v8"),
    (["serve", "--quant", "k4v4rv", "--port", "70000"], 2, "--port must be <= 65535"),  # k4v4rv taken
])
def test_help_and_argument_errors_import_no_torch(argv, code, shown):
    got, heavy, stdout, stderr = _run(argv)
    assert got == code
    assert shown in (stdout if code == 0 else stderr)
    assert heavy == []  # neither torch nor transformers nor the server's packages were imported


def test_a_library_import_registers_the_attention_at_once():
    script = ("import hf_pagedkv; from transformers import AttentionInterface; "
              "print('hf_pagedkv' in AttentionInterface._global_mapping, hf_pagedkv.PagedCache.__module__, "
              "hf_pagedkv.__version__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["True", "hf_pagedkv.adapter.paged_cache", "0.1.0"]


def test_under_the_command_the_face_loads_on_first_use():
    script = ("import sys, hf_pagedkv_cli, hf_pagedkv; light = 'torch' not in sys.modules; "
              "from hf_pagedkv import PagedCache; from transformers import AttentionInterface; "
              "print(light, PagedCache.__module__, 'hf_pagedkv' in AttentionInterface._global_mapping)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["True", "hf_pagedkv.adapter.paged_cache", "True"]


def test_subpackages_are_attributes_after_a_bare_import():
    script = ("import hf_pagedkv_cli, hf_pagedkv; print(hf_pagedkv.serving.Engine.__name__, hf_pagedkv.retention.SinkWindow.name, "
              "hf_pagedkv.PagedCache.__name__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["Engine", "sink_window", "PagedCache"]


def test_unknown_name_is_an_attribute_error():
    import hf_pagedkv

    with pytest.raises(AttributeError, match="module 'hf_pagedkv' has no attribute 'PagedCash'"):
        hf_pagedkv.PagedCash  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute '__wrapped__'"):
        hf_pagedkv.__wrapped__  # noqa: B018
    assert set(hf_pagedkv.__all__) <= set(dir(hf_pagedkv))
    # every exported name is loaded by the face's `_load` (a name added to __all__ alone would be a KeyError here)
    assert [n for n in hf_pagedkv.__all__ if getattr(hf_pagedkv, n).__name__.rsplit(".", 1)[-1] != n] == []


def test_block_size_candidates_match_the_planner():
    from hf_pagedkv.tools.cli_tools import BLOCK_SIZE_CANDIDATES
    from hf_pagedkv.tools.planning import BLOCK_SIZE_CANDIDATES as PLANNED

    assert BLOCK_SIZE_CANDIDATES == PLANNED == (4, 8, 16, 32, 64, 128)
