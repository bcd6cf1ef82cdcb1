"""`parse_retention`: a retention policy from a short spec (the CLI's `--retention`, `PagedCache(retention=...)`,
a request's `retention=`)."""

from __future__ import annotations

from hf_pagedkv.retention.key_diff import KeyDiff
from hf_pagedkv.retention.key_norm import KeyNorm
from hf_pagedkv.retention.kv_zip import KVzip
from hf_pagedkv.retention.policy import RetentionPolicy
from hf_pagedkv.retention.pyramid_kv import PyramidKV
from hf_pagedkv.retention.sink_window import SinkWindow
from hf_pagedkv.retention.snap_kv import SnapKV

_IMPORTANCE = {"key_norm": KeyNorm, "key_diff": KeyDiff, "snapkv": SnapKV, "snap_kv": SnapKV, "kv_zip": KVzip,
               "kvzip": KVzip}
_IMPORTANCE.update(pyramidkv=PyramidKV, pyramid_kv=PyramidKV, kv_zip_global=KVzip, kvzip_global=KVzip,
                   kv_zip_weighted=KVzip, kvzip_weighted=KVzip)
# the `KVzip` preset a name asks for (`KVZIP_PRESETS`): kv_zip is Kim et al.'s plain scoring, kv_zip_global and
# kv_zip_weighted the passkey eval's `kv_zip_global` and its best setting (docs/retention.md, passkey results)
_SETTINGS = {"kv_zip": {"scoring": "plain"}, "kvzip": {"scoring": "plain"},
             "kv_zip_global": {"scoring": "global"}, "kvzip_global": {"scoring": "global"},
             "kv_zip_weighted": {"scoring": "weighted"}, "kvzip_weighted": {"scoring": "weighted"}}


def parse_retention(spec: str) -> RetentionPolicy:
    """``"sink_window:4:1024"`` -> `SinkWindow(4, 1024)`; ``"key_norm:512"`` -> `KeyNorm(budget=512)`;
    ``"key_diff:0.5"`` -> `KeyDiff(compression_ratio=0.5)`; ``"snapkv:0.5"`` (or ``"snap_kv:0.5"``) ->
    `SnapKV(compression_ratio=0.5)`; ``"pyramidkv:0.5"`` (or ``"pyramid_kv:0.5"``) ->
    `PyramidKV(compression_ratio=0.5)`; ``"kv_zip:0.5"`` (or ``"kvzip:0.5"``) ->
    `KVzip(compression_ratio=0.5, scoring="plain")`; ``"kv_zip:0.5:0.25"`` -> `KVzip(compression_ratio=0.5,
    scoring="plain", recent_share=0.25)` (a third part, for any importance policy: its `recent_share`);
    ``"kv_zip_global:0.5"`` -> `KVzip(compression_ratio=0.5, scoring="global")` (the passkey eval's
    `kv_zip_global`; its cache needs ``config=``); ``"kv_zip_weighted:0.5"`` -> `KVzip(compression_ratio=0.5,
    scoring="weighted")` (the passkey eval's best, `KVzip`'s default; its cache needs ``config=``). Whitespace
    around the spec is ignored.

    Raises:
        ValueError: naming the part that is wrong and its form: an unknown policy name, the wrong number of parts or
            an empty one, a number that is not one (or neither a RATIO in (0, 1) nor an int BUDGET), or settings the
            policy refuses (e.g. a budget below its protected tokens).
    """
    if not isinstance(spec, str):
        raise ValueError(f"retention spec: expected a string such as 'kv_zip:0.5', got {type(spec).__name__}.")
    if not spec.strip(" :"):
        raise ValueError(f"retention spec {spec!r}: the spec is empty; expected NAME:VALUE, e.g. kv_zip:0.5 or "
                         "sink_window:4:1024 (`hf-pagedkv plan --help` gives the forms).")
    if not spec.isascii():  # int() and float() would take other scripts' digits (and look-alike spaces)
        raise ValueError(f"retention spec {spec!r}: use ASCII letters and digits only.")
    name, *parts = (p.strip() for p in spec.strip().split(":"))
    name = name.lower()
    if name != "sink_window" and name not in _IMPORTANCE:
        names = ", ".join(dict.fromkeys(["sink_window", *_IMPORTANCE]))
        raise ValueError(f"retention spec {spec!r}: unknown policy {name!r}; the policies: {names} (`hf-pagedkv plan "
                         "--help` gives their forms).")
    form = ("sink_window:SINK:WINDOW, two ints (e.g. sink_window:4:1024)" if name == "sink_window" else
            f"{name}:BUDGET or {name}:RATIO, then optionally :SHARE (e.g. {name}:512, {name}:0.5 or {name}:0.5:0.25)")
    counts = (2,) if name == "sink_window" else (1, 2)
    if len(parts) not in counts or "" in parts:  # (the parts are stripped)
        got = (f"part {parts.index('') + 1} after the name is empty" if "" in parts
               else f"{len(parts)} part{'s' if len(parts) != 1 else ''} after the name")
        raise ValueError(f"retention spec {spec!r}: {got}; expected {form}.")
    # the numbers first (each message names its part), then the policy's own checks
    if name == "sink_window":
        cls, kwargs = SinkWindow, dict(sink_tokens=_int(spec, "SINK", parts[0]), window=_int(spec, "WINDOW", parts[1]))
    else:
        cls, kwargs = _IMPORTANCE[name], dict(_SETTINGS.get(name, {}))
        value = _float(spec, "BUDGET or RATIO (an int of tokens kept, or a float in (0, 1))", parts[0])
        if len(parts) == 2:
            kwargs["recent_share"] = _float(spec, "SHARE (a float in [0, 1))", parts[1])
        if 0 < value < 1:
            kwargs["compression_ratio"] = value
        else:
            try:
                kwargs["budget"] = int(parts[0])
            except ValueError:
                raise ValueError(f"retention spec {spec!r}: {parts[0]!r} is neither a RATIO (a float in (0, 1), the "
                                 "fraction of the prompt removed) nor a BUDGET (an int, the tokens kept).") from None
    try:
        return cls(**kwargs)
    except ValueError as e:
        detail = str(e).rstrip(".").replace("`recent_share` must", "SHARE (`recent_share`) must").replace(
            "Lower sink_tokens/recent_tokens for a smaller budget",  # (the command line sets no sink/recent tokens)
            f"Give a larger BUDGET or a RATIO; a smaller budget needs the policy built in Python with fewer protected "
            f"tokens, e.g. {cls.__name__}(budget=..., sink_tokens=..., recent_tokens=...)")
        raise ValueError(f"retention spec {spec!r}: {detail}.") from None


def _int(spec: str, what: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"retention spec {spec!r}: {what} must be an int, got {text!r}.") from None


def _float(spec: str, what: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"retention spec {spec!r}: {what} is not a number: {text!r}.") from None
