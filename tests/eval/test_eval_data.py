"""The evaluation data ships inside the repository (eval/data/): the default data folder resolves there from any cwd,
the files are those of the data README (sha256), eval/ is not installed, and nothing reads a folder outside the repo."""

from __future__ import annotations

import hashlib
import re
import subprocess

import pytest

from eval.config import DEFAULT_DATA_DIR, EvalConfig, resolve_data_dir
from tests.eval_helpers import REPO

FILES = ("wikitext-2-raw/wiki.test.raw", "tinyshakespeare/input.txt", "qmsum/test.jsonl")


def readme_sha256() -> dict[str, str]:
    """{relative path: sha256} from the table of eval/data/README.md (rows like | `path` | ... | `hex` |)."""
    rows = re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", (DEFAULT_DATA_DIR / "README.md").read_text(),
                      re.MULTILINE)
    return dict(rows)


def test_default_data_dir_is_eval_data_in_the_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_PAGEDKV_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # resolved from the package, not the cwd
    assert DEFAULT_DATA_DIR == REPO / "eval" / "data" and DEFAULT_DATA_DIR.is_absolute()
    assert resolve_data_dir() == DEFAULT_DATA_DIR == EvalConfig().resolved_data_dir
    assert all((DEFAULT_DATA_DIR / name).is_file() for name in FILES)
    # the alternatives still win, in this order: data_dir, then $HF_PAGEDKV_DATA_DIR
    monkeypatch.setenv("HF_PAGEDKV_DATA_DIR", str(tmp_path))
    assert EvalConfig().resolved_data_dir == tmp_path
    assert EvalConfig(data_dir="/elsewhere").resolved_data_dir.as_posix() == "/elsewhere"


def test_data_files_have_the_sha256_of_the_data_readme():
    expected = readme_sha256()
    assert sorted(expected) == sorted(FILES)
    for name in FILES:
        digest = hashlib.sha256((DEFAULT_DATA_DIR / name).read_bytes()).hexdigest()
        assert digest == expected[name], name


def test_eval_is_not_an_installed_package():
    """`pip install .` installs hf_pagedkv only: eval/ is a folder of scripts run from a clone (a top-level package
    named `eval` in site-packages would clash with anything else of that name)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = pytest.importorskip("setuptools")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = setuptools.find_packages(where=str(REPO), include=config["packages"]["find"]["include"])
    assert "hf_pagedkv" in found and "hf_pagedkv.blocks" in found
    assert [name for name in found if not name.startswith("hf_pagedkv")] == []
    assert list(config["package-data"]) == ["hf_pagedkv"]
    assert (REPO / "eval" / "drift.py").is_file() and (DEFAULT_DATA_DIR / "README.md").is_file()  # still in the clone


def test_nothing_reads_data_from_outside_the_repository():
    """Tests, eval, benchmarks, notebooks and scripts find data from the repository (or a flag / env variable), never
    from CI's folder beside the checkout, which a user's clone does not have."""
    try:
        tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    pattern = re.compile(r"""shared[/\\]data|["']shared["']\s*/""")
    offenders = [name for name in tracked
                 if name.endswith((".py", ".ipynb", ".yaml", ".sh", ".toml")) and not name.startswith("eval/results/")
                 and pattern.search((REPO / name).read_text(encoding="utf-8"))]
    assert offenders == []
