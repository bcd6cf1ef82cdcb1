"""`LongContextConfig`: the settings of a long-context run (`python -m eval.long_context`), layered as dataclass
defaults, then a YAML file, then CLI flags (as `EvalConfig` for the drift suite)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hf_pagedkv.retention.kv_zip_scoring import MAX_VALUE_POWER
from hf_pagedkv.retention.score_pooling import POOLINGS

from .config import load_yaml, resolve_data_dir

#: Cache methods of the streaming-perplexity task. `recompute` is StreamingLLM's reference, the sliding window with
#: recomputation: each scored chunk is computed without a cache from exactly the sinks and its last tokens.
PPL_METHODS = ("full", "sink_window", "window_only", "key_norm", "key_diff", "recompute")
#: Methods of the passkey task (the budget there is a compression ratio of the context). `snap_kv` (query-aware)
#: runs the model with ``attn_implementation="hf_pagedkv"``, which hands the prefill's last queries to the cache;
#: so does `pyramid_kv` (`PyramidKV`: SnapKV's scores, budgets shrinking with depth over 4 tiers of layers).
#: `kv_zip` (query-agnostic) runs `compress_context` (KVzip's reconstruction pass) after the context's prefill;
#: `kv_zip_recent` is KVzip with H2O's split, a `recent_share` of the kept tokens given to the most recent ones;
#: `kv_zip_pooled` is KVzip with its scores max-pooled (or `kv_zip_pooling`) over `kv_zip_kernel` tokens (SnapKV's
#: clustering step); `kv_zip_global` is `kv_zip_pooled` with KVzip's ranking across layers (each layer its own
#: budget from the scores, `KVzipScoring(layer_budgets="global")`).
PASSKEY_METHODS = ("full", "sink_window", "key_norm", "key_diff", "snap_kv", "pyramid_kv", "kv_zip", "kv_zip_recent",
                   "kv_zip_pooled", "kv_zip_global")
TASKS = ("perplexity", "passkey")
_NOT_IN_NAME = ("output_dir", "overwrite", "data_dir", "num_threads")
#: the passkey methods that pool KVzip's scores (they read the `kv_zip_*` settings)
POOLED_METHODS = ("kv_zip_pooled", "kv_zip_global")
#: the settings that only some methods read, and those methods (a setting off its default needs one of them; a
#: run none of them is in leaves the setting out of its name)
_READERS = {"recent_share": ("kv_zip_recent",), "kv_zip_kernel": POOLED_METHODS, "kv_zip_pooling": POOLED_METHODS,
            "kv_zip_recent_share": POOLED_METHODS, "kv_zip_share_heads": POOLED_METHODS,
            "kv_zip_value_weighted": POOLED_METHODS, "kv_zip_value_power": POOLED_METHODS,
            "kv_zip_safeguard": ("kv_zip_global",)}
#: the settings added after runs were committed: at their defaults they stay out of the name, so those runs keep it
_NAMED_OFF_DEFAULT = ("question_in_prompt", "kv_zip_pooling", "kv_zip_recent_share", "kv_zip_safeguard",
                      "kv_zip_share_heads", "kv_zip_value_weighted", "kv_zip_value_power")


@dataclass
class LongContextConfig:
    """The settings of one long-context run. Every field can be set in a YAML file (same name) or by a CLI flag.

    Args:
        task (`str`, defaults to `"perplexity"`): `perplexity` (streaming perplexity beyond the budget over
            WikiText windows) or `passkey` (a passkey hidden in a local haystack, asked for after the compressed
            context).
        model (`str`, *optional*): transformers id, directory or `.gguf`; `None`: the bundled SmolLM2-135M-Instruct.
        num_threads (`int`, defaults to 0): torch CPU threads (0: torch's default).
        dataset (`str`, defaults to WikiText-2 test): text file under `data_dir` (the haystack of `passkey` too).
        data_dir (`str`, *optional*): defaults to `$HF_PAGEDKV_DATA_DIR`, else `eval/data/`.
        num_windows (`int`, defaults to 4): windows (perplexity).
        context_len (`int`, defaults to 8192): tokens per window (perplexity).
        budgets (`list[int]`, defaults to 512 1024 2048): tokens a retention policy keeps (perplexity).
        chunk (`int`, defaults to 64): tokens per forward step of the stream; a chunk's tokens see what is kept
            plus the chunk's earlier tokens.
        score_stride (`int`, defaults to 4): every `score_stride`-th chunk after the budget is scored (the
            recomputation reference runs one forward per scored chunk).
        sink_tokens (`int`, defaults to 4), recent_tokens (`int`, defaults to 64): the sinks of `sink_window` and
            `recompute`; the protected sinks / recent tokens of the importance policies (for `snap_kv`, the
            observation window whose queries score the context, kvpress's `window_size`).
        recent_share (`float`, defaults to 0.5): passkey, method `kv_zip_recent`: the fraction in [0, 1) of each
            head's kept tokens given to the most recent context tokens (`ImportancePolicy.recent_share`, H2O's split).
        kv_zip_kernel (`int`, defaults to 7): passkey, method `kv_zip_pooled`: the odd max-pooling kernel over
            KVzip's scores, in tokens (`KVzipScoring.kernel_size`).
        kv_zip_pooling (`str`, defaults to `"max"`): passkey, method `kv_zip_pooled`: `max` or `avg`, the pooling
            of that kernel (`KVzipScoring.pooling`).
        kv_zip_recent_share (`float`, defaults to 0.0): passkey, method `kv_zip_pooled`: the `recent_share` of its
            policy (as `recent_share` for `kv_zip_recent`), in [0, 1); 0 keeps the pooled scores' choice alone.
            `kv_zip_global` reads these three too.
        kv_zip_safeguard (`float`, defaults to 0.0): passkey, method `kv_zip_global`: the share in [0, 1] of each
            head's uniform budget it keeps before the ranking across layers (`KVzipScoring.safeguard`, AdaKV's).
        kv_zip_share_heads (`bool`, defaults to `False`): passkey, methods `kv_zip_pooled` and `kv_zip_global`: the KV
            heads of a layer keep the same tokens, ranked by the mean of their scores (`KVzipScoring.share_heads`).
        kv_zip_value_weighted (`bool`, defaults to `False`): passkey, methods `kv_zip_pooled` and `kv_zip_global`:
            each token's score times its relative value norm before the pooling and the ranking
            (`KVzipScoring.value_weighted`, VATP).
        kv_zip_value_power (`float`, defaults to 1.0): passkey, methods `kv_zip_pooled` and `kv_zip_global`, with
            `kv_zip_value_weighted`: the exponent of the relative value norm (`KVzipScoring.value_power`), in (0, 8].
        block_size (`int`, defaults to 16): `PagedCache` block size.
        methods (`list[str]`, *optional*): from `PPL_METHODS` (perplexity) or `PASSKEY_METHODS` (passkey); all of
            the task's by default.
        quants (`list[str]`, defaults to fp): KV formats (`QuantConfig` presets) each cache method also runs with
            (perplexity), for the memory-matched comparison of eviction against quantization (``key_diff+k8v4``).
        contexts (`list[int]`, defaults to 1024 2048 4096), depths (`list[int]`, defaults to 10 50 90),
            ratios (`list[float]`, defaults to 0.25 0.5 0.75), num_keys (`int`, defaults to 4): passkey contexts in
            tokens, needle depths in percent, compression ratios, and seeded keys per (context, depth).
        question_in_prompt (`bool`, defaults to `False`): passkey: `False` is kvpress's convention (the context is
            compressed, then the question is a new forward step: the compression cannot know the question); `True`
            is SnapKV's setting (the prompt is the context followed by the question, compressed as a whole before
            the first generated token, so SnapKV's observation window holds the question).
        seed (`int`, defaults to 0).
        output_dir (`str`, defaults to `"eval/runs"`), overwrite (`bool`, defaults to `False`).

    Raises:
        ValueError: a setting out of its range or of the wrong type, a method or quant not the task's, or a setting
            only some methods read (`recent_share`, the `kv_zip_*` ones) moved off its default while none of the
            chosen methods reads it (it would be silently ignored); the message names the methods that read it.
    """

    task: str = "perplexity"
    model: str | None = None
    num_threads: int = 0
    dataset: str = "wikitext-2-raw/wiki.test.raw"
    data_dir: str | None = None
    num_windows: int = 4
    context_len: int = 8192
    budgets: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    chunk: int = 64
    score_stride: int = 4
    sink_tokens: int = 4
    recent_tokens: int = 64
    recent_share: float = 0.5
    kv_zip_kernel: int = 7
    kv_zip_pooling: str = "max"
    kv_zip_recent_share: float = 0.0
    kv_zip_safeguard: float = 0.0
    kv_zip_share_heads: bool = False
    kv_zip_value_weighted: bool = False
    kv_zip_value_power: float = 1.0
    block_size: int = 16
    methods: list[str] | None = None
    quants: list[str] = field(default_factory=lambda: ["fp"])
    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[int] = field(default_factory=lambda: [10, 50, 90])
    ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    num_keys: int = 4
    question_in_prompt: bool = False
    seed: int = 0
    output_dir: str = "eval/runs"
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"LongContextConfig.task must be one of {TASKS}, got {self.task!r}.")
        for name in ("num_windows", "context_len", "chunk", "score_stride", "block_size", "num_keys", "kv_zip_kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LongContextConfig.{name} must be a positive int, got {value!r}.")
        if self.methods is None:
            self.methods = list(PPL_METHODS if self.task == "perplexity" else PASSKEY_METHODS)
        for name, kind in (("budgets", int), ("contexts", int), ("depths", int), ("ratios", float),
                           ("methods", str), ("quants", str)):
            value = getattr(self, name)
            if isinstance(value, (str, int, float)):
                value = [v for v in re.split(r"[,\s]+", str(value)) if v]
            setattr(self, name, [kind(v) for v in value])
        allowed = PPL_METHODS if self.task == "perplexity" else PASSKEY_METHODS
        bad = [m for m in self.methods if m not in allowed]
        if bad:
            raise ValueError(f"LongContextConfig.methods: {bad} not among the {self.task} methods {allowed}.")
        from hf_pagedkv.config import QuantConfig

        for q in self.quants:
            QuantConfig.resolve(q)  # raises ValueError naming the preset
        if self.task == "perplexity" and any(b >= self.context_len or b <= self.sink_tokens + self.recent_tokens
                                             for b in self.budgets):
            raise ValueError(f"LongContextConfig.budgets {self.budgets} must lie between sink_tokens + recent_tokens "
                             f"({self.sink_tokens + self.recent_tokens}) and context_len ({self.context_len}).")
        if self.kv_zip_kernel % 2 == 0:
            raise ValueError(f"LongContextConfig.kv_zip_kernel must be odd (the pooling is centred on each token), "
                             f"got {self.kv_zip_kernel}.")
        if self.kv_zip_pooling not in POOLINGS:
            raise ValueError(f"LongContextConfig.kv_zip_pooling must be 'max' or 'avg', got {self.kv_zip_pooling!r}.")
        for name in ("recent_share", "kv_zip_recent_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"LongContextConfig.{name} must be a float in [0, 1), got {value!r}.")
        if isinstance(self.kv_zip_safeguard, bool) or not isinstance(self.kv_zip_safeguard, (int, float)) \
                or not 0 <= self.kv_zip_safeguard <= 1:
            raise ValueError(f"LongContextConfig.kv_zip_safeguard must be a number in [0, 1], got "
                             f"{self.kv_zip_safeguard!r}.")
        for name in ("kv_zip_share_heads", "kv_zip_value_weighted"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LongContextConfig.{name} must be true or false, got {getattr(self, name)!r}.")
        value = self.kv_zip_value_power
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_VALUE_POWER:
            raise ValueError(f"LongContextConfig.kv_zip_value_power (--kv-zip-value-power) must be a number in "
                             f"(0, {MAX_VALUE_POWER}], e.g. 2 (1: the plain value weighting), got {value!r}.")
        if value != 1 and not self.kv_zip_value_weighted:
            raise ValueError(f"LongContextConfig.kv_zip_value_power={value!r} is the exponent of the value weighting: "
                             "set kv_zip_value_weighted (--kv-zip-value-weighted) too, or leave it at 1.")
        unread = [name for name in _READERS if getattr(self, name) != _DEFAULTS[name] and not self.reads(name)]
        if unread:  # else the flag would be silently ignored, and the run named and reported as if it were read
            readers = [m for m in PASSKEY_METHODS if any(m in _READERS[name] for name in unread)]
            settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in unread)
            fix = (f"add one of {readers} to the methods" if self.task == "passkey" else
                   f"{'it is a passkey setting' if len(unread) == 1 else 'they are passkey settings'}: use --task "
                   f"passkey with one of {readers} among the methods")
            raise ValueError(f"LongContextConfig: {settings} set, but none of the methods {self.methods} (task "
                             f"{self.task}) reads {'it' if len(unread) == 1 else 'them'}; {fix}, or leave "
                             f"{'it' if len(unread) == 1 else 'them'} at the default.")
        if any(not 0 < r < 1 for r in self.ratios) or any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError(f"LongContextConfig: ratios {self.ratios} must be in (0, 1), depths {self.depths} in "
                             "[0, 100].")

    def reads(self, name: str) -> bool:
        """Whether one of `methods` reads the setting `name` (`True` for a setting every run reads)."""
        return name not in _READERS or bool(set(_READERS[name]) & set(self.methods))

    @property
    def resolved_data_dir(self) -> Path:
        return resolve_data_dir(self.data_dir)

    def to_dict(self) -> dict:
        return asdict(self)

    def run_dir(self) -> Path:
        """`output_dir/<task>-<key settings>-<hash of every setting that changes the numbers>`."""
        ident = {k: v for k, v in self.to_dict().items() if k not in _NOT_IN_NAME}
        for name in _READERS:  # (each added after runs were committed that none of its methods was in)
            if not self.reads(name):
                del ident[name]
        for name in _NAMED_OFF_DEFAULT:
            if name in ident and ident[name] == _DEFAULTS[name]:
                del ident[name]
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:6]
        if self.task == "perplexity":
            key = f"w{self.num_windows}-n{self.context_len}-b{'_'.join(map(str, self.budgets))}-c{self.chunk}"
        else:
            key = f"n{'_'.join(map(str, self.contexts))}-r{'_'.join(map(str, self.ratios))}-k{self.num_keys}"
            key += "-qin" if self.question_in_prompt else ""
        return Path(self.output_dir) / f"long-{self.task}-{key}-{digest}"


_DEFAULTS = {f.name: f.default for f in fields(LongContextConfig)}


def _field_help() -> dict[str, str]:
    """Each field's `--flag` help: its entry in `LongContextConfig`'s Args (type, default and meaning; an entry
    that documents several fields is given to each), so the docstring stays the one place they are written."""
    args = LongContextConfig.__doc__.split("Args:\n", 1)[1].split("\n    Raises:", 1)[0]
    helps = {}
    for entry in re.split(r"\n(?=        \S)", args.strip("\n")):
        text = " ".join(entry.split())
        for name in re.findall(r"(?:^|, )(\w+) \(", text.split("):", 1)[0]):
            helps[name] = text.replace("%", "%%")  # (argparse formats help with %)
    return helps


def resolve(argv: list[str] | None = None, prog: str = "python -m eval.long_context"):
    """`(LongContextConfig, argparse.Namespace)` from defaults, then `--config FILE`, then the other flags."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", dest="config_file", help="YAML file of settings (CLI flags override it)")
    helps = _field_help()
    for f in fields(LongContextConfig):
        flag, kw = "--" + f.name.replace("_", "-"), {"dest": f.name, "help": helps[f.name]}
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", **kw)
        elif f.type.startswith("list"):
            parser.add_argument(flag, nargs="+", **kw)
        elif f.type == "int":
            parser.add_argument(flag, type=int, **kw)
        elif f.type == "float":
            parser.add_argument(flag, type=float, **kw)
        else:
            parser.add_argument(flag, **kw)
    parser.add_argument("-v", "--verbose", action="store_true", default=False)
    args = parser.parse_args(argv)
    settings = {}
    if getattr(args, "config_file", None):
        try:
            settings.update(load_yaml(args.config_file, LongContextConfig))
        except ValueError as exc:
            parser.error(str(exc))
    settings.update({k: v for k, v in vars(args).items() if k not in ("config_file", "verbose")})
    try:
        return LongContextConfig(**settings), args
    except ValueError as exc:  # a setting out of range: argparse's usage error, not a traceback
        parser.error(str(exc))
