"""pyproject.toml tells the truth: the core dependencies are what `import hf_pagedkv` imports, the supported
transformers range and Python floor match the installed transformers, and the demo model's loaders are an extra."""

import ast
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


# the modules `import hf_pagedkv` and the CLI entry point load, listed by a fresh interpreter
_LOADED = """
import json, sys
import hf_pagedkv, hf_pagedkv.tools.cli
hf_pagedkv.PagedCache  # the package loads on first use
print(json.dumps(sorted((name, getattr(mod, "__file__", None)) for name, mod in sys.modules.items()
                        if name.split(".")[0] == "hf_pagedkv")))
"""


def _module_level_imports(path: str) -> set[str]:
    """Top-level package names a module imports unconditionally (module level, outside try / if blocks)."""
    tree = ast.parse(Path(path).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_dependencies_are_what_import_hf_pagedkv_imports():
    out = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = json.loads(out.stdout)
    assert len(loaded) > 20 and ["hf_pagedkv.tools.cli", str(ROOT / "hf_pagedkv/tools/cli.py")] in loaded
    distributions = importlib.metadata.packages_distributions()

    def dists(paths) -> set[str]:
        imported = set().union(*(_module_level_imports(path) for path in paths))
        third_party = imported - set(sys.stdlib_module_names) - {"hf_pagedkv", "__future__"}
        return {dist.lower() for name in third_party for dist in distributions[name]}

    core = _names(PROJECT["dependencies"])
    assert core == {"torch", "transformers", "safetensors", "packaging"}
    assert dists(path for _, path in loaded if path) <= core  # `import hf_pagedkv` needs nothing more
    # and each is used at module level somewhere in the package (safetensors: prefix files, loaded on first use)
    assert core <= dists(str(p) for p in (ROOT / "hf_pagedkv").rglob("*.py"))

def test_the_demo_extra_holds_the_gguf_loaders_and_dev_includes_it():
    from hf_pagedkv.tools.models import _GGUF_LOADER_PACKAGES

    extras = PROJECT["optional-dependencies"]
    assert set(_GGUF_LOADER_PACKAGES) <= _names(extras["demo"]) == {"gguf", "accelerate", "sentencepiece"}
    assert not _names(extras["demo"]) & _names(PROJECT["dependencies"])
    for extra in ("dev", "eval"):  # the tests, and the drift suite and notebooks, load the demo model
        assert any(r.startswith("hf_pagedkv[") and "demo" in Requirement(r).extras for r in extras[extra]), extra


def test_supported_range_and_python_floor_match_the_installed_transformers():
    (spec,) = [r for r in PROJECT["dependencies"] if Requirement(r).name == "transformers"]
    supported = Requirement(spec).specifier
    assert Version(transformers.__version__) in supported
    assert [v for v in ("5.22.2", "5.23.0", "5.24.0", "5.25.0", "5.26.0") if v in supported] == \
        ["5.23.0", "5.24.0", "5.25.0"]
    # the pin is the newest supported version
    pins = dict(line.split("==") for line in (ROOT / "scripts/constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["transformers"] == "5.25.0"
    ours = SpecifierSet(PROJECT["requires-python"])
    theirs = SpecifierSet(importlib.metadata.metadata("transformers")["Requires-Python"])
    for minor in range(8, 16):
        assert (f"3.{minor}" in ours) == (f"3.{minor}.0" in theirs), minor
