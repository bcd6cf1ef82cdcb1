"""A missing optional dependency raises an ImportError naming a command that works: hf_pagedkv is installed from a
clone (it is not on a package index), so the message gives ``pip install ".[extra]"`` and the extra's packages."""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import pytest
import torch

from hf_pagedkv import BlockPool

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _prometheus():
    from hf_pagedkv.observe.prometheus import start_prometheus_server

    start_prometheus_server(BlockPool())


def _bitsandbytes():
    from hf_pagedkv.storage.codecs.bnb import BnbCodec

    BnbCodec(4, "token", 64).encode(torch.zeros(32, 64))


def _datasets(tmp_path):
    from hf_pagedkv.tools.cli_tools import _texts

    path = tmp_path / "notes.txt"
    path.write_text("some text\n")
    _texts(argparse.Namespace(text=str(path), sample_by="line", max_samples=10))


def _rouge():
    from eval.tasks.summarization import metrics

    metrics._scorer.cache_clear()
    try:
        metrics.rouge_l("a summary", "the reference")
    finally:
        metrics._scorer.cache_clear()


@pytest.mark.parametrize("missing, extra, package, call", [
    (["prometheus_client"], "metrics", "'prometheus_client>=0.20'", lambda tmp: _prometheus()),
    (["bitsandbytes", "bitsandbytes.functional"], "quant", "'bitsandbytes>=0.45'", lambda tmp: _bitsandbytes()),
    (["datasets"], "planning", "'datasets>=2.19'", _datasets),
    (["rouge_score"], "eval", "'rouge-score>=0.1.2'", lambda tmp: _rouge()),
])
def test_missing_dependency_names_the_command_that_works_from_a_clone(missing, extra, package, call, monkeypatch,
                                                                        tmp_path):
    for name in missing:  # `import name` raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError) as e:
        call(tmp_path)
    message = str(e.value)
    assert f'pip install ".[{extra}]" (the `{extra}` extra, run in a clone of hf_pagedkv)' in message
    assert f"or pip install {package}" in message
    assert "hf_pagedkv[" not in message  # the form that fails: hf_pagedkv is on no package index


def test_the_named_extras_exist_with_the_named_packages():
    """Each extra a message names is in pyproject.toml and installs the package the message names."""
    from hf_pagedkv.errors import install_hint

    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, package in [("metrics", "prometheus_client>=0.20"), ("quant", "bitsandbytes>=0.45"),
                           ("planning", "datasets>=2.19"), ("eval", "rouge-score>=0.1.2")]:
        assert package in extras[extra]
        assert install_hint(extra, repr(package)).endswith(f"or pip install '{package}'")


def test_no_message_names_an_index_install_of_hf_pagedkv():
    """No source file of the package or of eval/ tells a user to ``pip install 'hf_pagedkv[...]'``."""
    pattern = re.compile(r"pip install\s+['\"]?hf_pagedkv\[")
    files = [path for folder in ("hf_pagedkv", "eval") for path in (ROOT / folder).rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == []
