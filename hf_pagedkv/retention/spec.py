"""`parse_retention`: a retention policy from a short command-line spec (`--retention` of the CLI)."""

from __future__ import annotations

from hf_pagedkv.retention.key_diff import KeyDiff
from hf_pagedkv.retention.key_norm import KeyNorm
from hf_pagedkv.retention.kv_zip import KVzip
from hf_pagedkv.retention.policy import RetentionPolicy
from hf_pagedkv.retention.pyramid_kv import PyramidKV
from hf_pagedkv.retention.sink_window import SinkWindow
from hf_pagedkv.retention.snap_kv import SnapKV

SPEC_HELP = ("sink_window:SINK:WINDOW (StreamingLLM), key_norm:BUDGET or key_norm:RATIO, key_diff:BUDGET or "
             "key_diff:RATIO, snapkv:BUDGET or snapkv:RATIO (SnapKV; needs attn_implementation=\"hf_pagedkv\"), "
             "pyramidkv:BUDGET or pyramidkv:RATIO (PyramidKV, 4 tiers; the same attention), "
             "kv_zip:BUDGET or kv_zip:RATIO (KVzip; needs the same attention and compress_context), "
             "kv_zip_global:BUDGET or kv_zip_global:RATIO (KVzip ranked across layers, max-pooled over 7 tokens) "
             "(BUDGET: tokens kept; RATIO: a float in (0, 1), the fraction of the prompt removed); every importance "
             "policy also takes :SHARE after it, a float in [0, 1): the share of the kept tokens given to the most "
             "recent ones (H2O's split, e.g. kv_zip:0.5:0.5)")
_IMPORTANCE = {"key_norm": KeyNorm, "key_diff": KeyDiff, "snapkv": SnapKV, "snap_kv": SnapKV, "kv_zip": KVzip,
               "kvzip": KVzip}
_IMPORTANCE.update(pyramidkv=PyramidKV, pyramid_kv=PyramidKV, kv_zip_global=KVzip, kvzip_global=KVzip)
# the settings a name adds: kv_zip_global is the passkey eval's `kv_zip_global` (its best KVzip setting)
_SETTINGS = {"kv_zip_global": {"layer_budgets": "global", "kernel_size": 7},
             "kvzip_global": {"layer_budgets": "global", "kernel_size": 7}}


def parse_retention(spec: str) -> RetentionPolicy:
    """``"sink_window:4:1024"`` -> `SinkWindow(4, 1024)`; ``"key_norm:512"`` -> `KeyNorm(budget=512)`;
    ``"key_diff:0.5"`` -> `KeyDiff(compression_ratio=0.5)`; ``"snapkv:0.5"`` (or ``"snap_kv:0.5"``) ->
    `SnapKV(compression_ratio=0.5)`; ``"pyramidkv:0.5"`` (or ``"pyramid_kv:0.5"``) ->
    `PyramidKV(compression_ratio=0.5)`; ``"kv_zip:0.5"`` (or ``"kvzip:0.5"``) -> `KVzip(compression_ratio=0.5)`;
    ``"kv_zip:0.5:0.25"`` -> `KVzip(compression_ratio=0.5, recent_share=0.25)` (a third part, for any importance
    policy: its `recent_share`); ``"kv_zip_global:0.5"`` -> `KVzip(compression_ratio=0.5, kernel_size=7,
    layer_budgets="global")` (the passkey eval's `kv_zip_global`; its cache needs ``config=``).

    Raises:
        ValueError: an unknown policy name or malformed numbers (the message lists the forms, `SPEC_HELP`).
    """
    name, _, rest = spec.strip().partition(":")
    parts = [p for p in rest.split(":") if p]
    try:
        if name == "sink_window" and len(parts) == 2:
            return SinkWindow(sink_tokens=int(parts[0]), window=int(parts[1]))
        if name in _IMPORTANCE and len(parts) in (1, 2):
            cls = _IMPORTANCE[name]
            value = float(parts[0])
            extra = dict(_SETTINGS.get(name, {}), **({"recent_share": float(parts[1])} if len(parts) == 2 else {}))
            if 0 < value < 1:
                return cls(compression_ratio=value, **extra)
            return cls(budget=int(parts[0]), **extra)  # 0: a budget
    except ValueError as e:
        detail = str(e) if str(e).startswith("`") else f"expected one of {SPEC_HELP}"  # int('a') says nothing useful
        raise ValueError(f"--retention {spec!r}: {detail.rstrip('.')}.") from None
    raise ValueError(f"--retention {spec!r}: expected one of {SPEC_HELP}.")
