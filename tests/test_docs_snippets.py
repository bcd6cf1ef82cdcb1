"""Every ```python block of README.md and docs/*.md runs as written.

The blocks of one file run in order in one namespace, fresh for each file (a guide may build its model in its first
block and use it in the next ones), from a temporary working directory. The real model would be too slow here, so
`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained` and `hf_pagedkv.tools.models.load_model`
return a tiny random Llama (2 layers, 2 KV heads, head_dim 16) and its small BPE tokenizer, whatever name a block
gives (`tests/eval_helpers.tiny_model_dir`). A block placed right after an HTML comment
``<!-- snippet: skip REASON -->`` is not run (a block that needs several processes, a network port or a GPU); the
reason must be given. The test fails if a block raises.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

import hf_pagedkv
import hf_pagedkv.tools.models as models
from tests.eval_helpers import tiny_model_dir

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# an optional marker comment on the line(s) right before the fence, then the fenced block
BLOCK = re.compile(r"(?:<!--\s*snippet:\s*(?P<marker>[^>]*?)\s*-->[ \t]*\n)?^```python[ \t]*\n(?P<code>.*?)^```",
                   re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, str | None, str]]:
    """`(line of the fence, marker or None, code)` for every ```python block of `path`, in order."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start("code")), m.group("marker"), m.group("code")) for m in BLOCK.finditer(text)]


@pytest.fixture
def tiny_loaders(monkeypatch, tmp_path):
    """Loaders that return the tiny model whatever name they get; the working directory is a temporary one."""
    path = tiny_model_dir()
    model_from_pretrained = transformers.AutoModelForCausalLM.from_pretrained
    tokenizer_from_pretrained = transformers.AutoTokenizer.from_pretrained
    load_model = models.load_model
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda name, *args, **kwargs: model_from_pretrained(path, *args, **kwargs).eval())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda name, *args, **kwargs: tokenizer_from_pretrained(path, *args, **kwargs))
    monkeypatch.setattr(models, "load_model", lambda name_or_path=None, **kwargs: load_model(path, **kwargs))
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_block_finder_reads_markers_and_code(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```python\nx = 1\n```\n<!-- snippet: skip needs two processes -->\n```python\ny = 2\n```\n"
                   "```bash\nls\n```\n")
    assert python_blocks(doc) == [(2, None, "x = 1\n"), (6, "skip needs two processes", "y = 2\n")]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(path, tiny_loaders):
    blocks = python_blocks(path)
    namespace: dict = {"__name__": "__snippet__"}
    for line, marker, code in blocks:
        if marker is not None:
            assert re.fullmatch(r"skip \S.*", marker), f"{path.name}:{line}: a marker is 'skip REASON', got {marker!r}"
            continue
        try:
            exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - any error of a documented block is a failure
            pytest.fail(f"{path.relative_to(ROOT)}, the block at line {line} raised {type(exc).__name__}: {exc}")
    for value in list(namespace.values()):  # give back what a file's blocks left open
        if isinstance(value, hf_pagedkv.PagedCache):
            value.release()


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", FILES + [ROOT / "eval" / "README.md", ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    """Links to files of the repository name files that exist, and their `#anchor` a heading of that file."""
    text = path.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(target)
    assert broken == [], f"{path.relative_to(ROOT)}: links to missing files or headings"


def test_the_signatures_the_readme_shows_are_the_codes():
    """Each `Name(...)` line of the README's ```text blocks names a public callable of `hf_pagedkv` with exactly its
    parameters: names, order, keyword-only marker, defaults and `**kwargs`."""
    import ast
    import inspect

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.findall(r"^([A-Za-z_]\w*)\((.*?)\)$", "\n".join(re.findall(r"^```text\n(.*?)^```", text, re.S | re.M)),
                       re.S | re.M)
    assert {name for name, _ in shown} >= {"PagedCache", "BlockPool"}
    for name, params in shown:
        doc = ast.parse(f"def f({' '.join(params.split())}): pass").body[0].args
        kinds = inspect.Parameter
        documented = [(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in doc.args]
        documented += [(a.arg, kinds.KEYWORD_ONLY) for a in doc.kwonlyargs]
        documented += [(doc.kwarg.arg, kinds.VAR_KEYWORD)] if doc.kwarg else []
        defaults = dict(zip([a.arg for a in doc.args][len(doc.args) - len(doc.defaults):],
                            [ast.literal_eval(d) for d in doc.defaults]))
        defaults.update({a.arg: ast.literal_eval(d) for a, d in zip(doc.kwonlyargs, doc.kw_defaults) if d is not None})
        real = inspect.signature(getattr(hf_pagedkv, name)).parameters.values()
        assert documented == [(p.name, p.kind) for p in real], name
        assert defaults == {p.name: p.default for p in real if p.default is not p.empty}, name


@pytest.mark.parametrize("path", FILES + [ROOT / "eval" / "README.md", ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_the_docs_name_exists(path):
    """Paths such as `benchmarks/memory.py`, `tests/adapter/test_padding.py` or `storage/heap.py` (inside the package)
    name files that exist, so a moved or deleted file shows up here."""
    text = path.read_text(encoding="utf-8")
    folders = "benchmarks|tests|eval|examples|scripts|hf_pagedkv"
    named = set(re.findall(rf"(?<![\w/.])((?:{folders})/[\w/]+\.(?:py|c|yaml|ipynb|sh))", text))
    inside = set(re.findall(r"`((?:storage|adapter|attention|pool|retention|observe|tools)/[\w/]+\.(?:py|c))`", text))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    missing += sorted(p for p in inside if not (ROOT / "hf_pagedkv" / p).exists())
    assert missing == [], f"{path.relative_to(ROOT)} names files that do not exist"
