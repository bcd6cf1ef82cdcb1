"""The `hf-pagedkv` console script.

It is a module of its own, outside the package, so that `import hf_pagedkv` can tell that a command line is
starting: the package face then loads on first use, and `hf-pagedkv --help` or an argument error answers without
importing torch or transformers. A library import (`import hf_pagedkv`) loads the face at once, which registers the
"hf_pagedkv" attention implementation in transformers.
"""

from hf_pagedkv.tools.cli import main

__all__ = ["main"]
