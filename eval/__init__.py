"""The hf_pagedkv drift suite: how much a cache configuration changes a model's outputs, and what it saves.

`python -m eval.drift --help` (or `hf-pagedkv eval --help`) lists the settings of `EvalConfig`.
"""

from .config import EvalConfig

__all__ = ["EvalConfig", "run"]


def run(cfg: EvalConfig, model=None, tokenizer=None) -> dict:
    """Run (or skip, when finished) the drift evaluation `cfg`; see `eval.drift.run`."""
    from .drift import run as _run

    return _run(cfg, model=model, tokenizer=tokenizer)
