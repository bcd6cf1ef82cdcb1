"""`EvalConfig`: the settings of a drift run, layered as dataclass defaults, then a YAML file, then CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

#: Cache configurations of `PagedCache` (quantization presets of `hf_pagedkv.QuantConfig`; `fp` is unquantized).
PAGED_CONFIGS = ("fp", "v8", "k8v8", "k8v4", "k4v4", "k4v2", "k2v2", "k4v8",
                 # rotated keys (`QuantConfig(rotate_keys=True)`), 3-bit codes, fp8 values (per-group or `b`: per-block
                 # scales)
                 "k8v4r", "k4v4r", "k4v3r", "k3v3r", "k4v3", "k3v3", "k8ve4m3r", "k4ve4m3", "k4ve4m3r", "k4ve4m3b",
                 "k4ve5m2r", "ke4m3ve4m3",
                 # rotated keys and values (`rotate_values=True` too)
                 "k8v4rv", "k4v4rv", "k4v3rv", "k3v3rv", "k4v2rv")
#: Reference columns: transformers' `QuantizedCache` with a backend and a bit width.
REFERENCE_CONFIGS = ("quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2")
#: What a run compares by default: the ladder (values quantized first) and the references. `k4v8` (keys first) and
#: `k2v2` are ablations a run names explicitly (`--configs ... k4v8`, or the reference YAML files).
DEFAULT_CONFIGS = ("fp", "v8", "k8v8", "k8v4", "k4v4", "k4v2") + REFERENCE_CONFIGS
TASKS = ("perplexity", "summarization")
#: Data file each task reads when `dataset` is not set (relative to `data_dir`).
TASK_DATASETS = {"perplexity": "wikitext-2-raw/wiki.test.raw", "summarization": "qmsum/test.jsonl"}
DTYPES = ("float32", "bfloat16", "float16")
#: The data shipped with the suite (eval/data/ of the clone the suite runs from): found from this file, not the cwd,
#: so it is the same folder whatever the working directory.
DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"
#: Settings that do not change the numbers of a run, so they are left out of its name.
_NOT_IN_NAME = ("output_dir", "overwrite", "run_name", "data_dir", "device", "num_threads")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data folder: `data_dir` if given, else `$HF_PAGEDKV_DATA_DIR` if set, else `DEFAULT_DATA_DIR`.

    Not checked for existence (a missing file is reported by whoever opens it)."""
    return Path(data_dir or os.environ.get("HF_PAGEDKV_DATA_DIR") or DEFAULT_DATA_DIR)


@dataclass
class EvalConfig:
    """The settings of one drift run. Every field can be set in a YAML file (same name) or by a CLI flag
    (`--prefill-len 2048`); CLI flags override the file, which overrides these defaults.

    Args:
        task (`str`, defaults to `"perplexity"`): `perplexity` (teacher-forced scoring, KL, top-1, greedy
            continuation, per-layer K/V error) or `summarization` (QMSum query summaries, ROUGE-L).
        model (`str`, *optional*): transformers id, local directory or `.gguf` file; `None` loads the bundled
            SmolLM2-135M-Instruct (`hf_pagedkv.tools.models.load_model`).
        dtype (`str`, defaults to `"float32"`): model and cache dtype, one of `DTYPES`.
        device (`str`, defaults to `"auto"`): `auto` (the accelerate process's device), `cpu` or `cuda`.
        num_threads (`int`, defaults to 0): torch CPU threads per process; 0 keeps torch's default. On a busy
            machine 1 can be several times faster than oversubscribed threads (torchrun sets 1 per process).
        dataset (`str`, *optional*): a local `.txt`/`.raw`/`.json`/`.jsonl` file or directory (absolute, or
            relative to `data_dir`), or a `datasets` name; defaults to the task's file in `TASK_DATASETS`.
        dataset_config (`str`, *optional*), split (`str`, defaults to `"test"`): for `datasets` names.
        text_field (`str`, defaults to `"text"`): the column holding text in JSON/JSONL/`datasets` rows.
        data_dir (`str`, *optional*): directory relative dataset paths start from; defaults to
            `$HF_PAGEDKV_DATA_DIR`, else `DEFAULT_DATA_DIR` (the `eval/data/` folder shipped with the suite).
        num_windows (`int`, defaults to 20): windows (perplexity) or examples (summarization) evaluated.
        prefill_len (`int`, defaults to 1792): tokens prefilled before scoring (perplexity); the longest prompt
            in tokens (summarization).
        score_len (`int`, defaults to 256): teacher-forced tokens decoded one at a time through the cache and
            scored; a perplexity window holds `prefill_len + score_len + 1` tokens.
        gen_len (`int`, defaults to 64): greedy tokens generated after the prefill (perplexity) or the longest
            summary in tokens (summarization).
        configs (`list[str]`): the cache configurations compared with the `DynamicCache` baseline, from
            `PAGED_CONFIGS` and `REFERENCE_CONFIGS`.
        block_size (`int`, *optional*): `PagedCache` block size in tokens; `None` keeps `PagedCache`'s default
            (which may differ between unquantized and quantized storage).
        qc_group_size (`int`, defaults to 64), qc_residual_length (`int`, defaults to 128): `QuantizedCache`
            group size and full-precision residual window (tokens) of the reference columns.
        seed (`int`, defaults to 0): seed set before every cache configuration's pass over an example.
        output_dir (`str`, defaults to `"eval/runs"`): parent of the run directories.
        run_name (`str`, *optional*): the run directory's name; derived from the settings by default.
        overwrite (`bool`, defaults to `False`): redo a finished run instead of skipping it.
    """

    task: str = "perplexity"
    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    num_threads: int = 0
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "test"
    text_field: str = "text"
    data_dir: str | None = None
    num_windows: int = 20
    prefill_len: int = 1792
    score_len: int = 256
    gen_len: int = 64
    configs: list[str] = field(default_factory=lambda: list(DEFAULT_CONFIGS))
    block_size: int | None = None
    qc_group_size: int = 64
    qc_residual_length: int = 128
    seed: int = 0
    output_dir: str = "eval/runs"
    run_name: str | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first setting that is out of range."""
        _choice("task", self.task, TASKS)
        _choice("dtype", self.dtype, DTYPES)
        for name in ("num_windows", "prefill_len", "score_len", "gen_len", "block_size", "qc_group_size",
                     "qc_residual_length"):
            value = getattr(self, name)
            if name == "block_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EvalConfig.{name} must be a positive int, got {value!r}.")
        if isinstance(self.configs, str):
            self.configs = [c for c in re.split(r"[,\s]+", self.configs) if c]
        if not self.configs:
            raise ValueError("EvalConfig.configs is empty; name at least one of "
                             f"{', '.join(PAGED_CONFIGS + REFERENCE_CONFIGS)}.")
        for name in self.configs:
            _choice("configs", name, PAGED_CONFIGS + REFERENCE_CONFIGS)
        if len(set(self.configs)) != len(self.configs):
            raise ValueError(f"EvalConfig.configs names a config twice: {self.configs}.")
        if isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ValueError(f"EvalConfig.num_threads must be an int >= 0 (0: torch's default), "
                             f"got {self.num_threads!r}.")
        if not isinstance(self.seed, int):
            raise ValueError(f"EvalConfig.seed must be an int, got {self.seed!r}.")

    # -- resolved values -------------------------------------------------------------------------------------------
    @property
    def dataset_name(self) -> str:
        """`dataset`, or the task's default data file."""
        return self.dataset or TASK_DATASETS[self.task]

    @property
    def resolved_data_dir(self) -> Path:
        """Where relative dataset paths start: `data_dir`, `$HF_PAGEDKV_DATA_DIR`, or `DEFAULT_DATA_DIR` (eval/data)."""
        return resolve_data_dir(self.data_dir)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def identity(self) -> dict:
        """The settings that determine a run's numbers (everything but paths and switches), with the task's dataset."""
        d = {k: v for k, v in self.to_dict().items() if k not in _NOT_IN_NAME}
        d["dataset"] = self.dataset_name
        return d

    def run_dir_name(self) -> str:
        """`run_name`, or a readable name from the settings plus a hash of all of them, e.g.
        ``perplexity-wiki.test-SmolLM2-135M-Instruct-w20-p1792-s256-g64-3f9a1c``."""
        if self.run_name:
            return self.run_name
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:6]
        data = _slug(Path(self.dataset_name).stem if _looks_local(self.dataset_name) else self.dataset_name)
        if self.dataset_config:
            data += "-" + _slug(self.dataset_config)
        model = _slug(Path(self.model).name if self.model else "SmolLM2-135M-Instruct")
        return (f"{self.task}-{data}-{model}-w{self.num_windows}-p{self.prefill_len}-s{self.score_len}"
                f"-g{self.gen_len}-{digest}")

    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_dir_name()


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"EvalConfig.{name}: {value!r} is not one of {', '.join(map(str, allowed))}.")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-")[:48] or "x"


def _looks_local(name: str) -> bool:
    return name.endswith((".txt", ".raw", ".json", ".jsonl")) or os.sep in name or os.path.exists(name)


# -- layering: defaults < YAML < CLI -------------------------------------------------------------------------------
def load_yaml(path: str | os.PathLike, cls: type | None = None) -> dict:
    """Read a YAML mapping of the fields of `cls` (`EvalConfig` by default; `LongContextConfig` too). An empty file
    is an empty mapping (the defaults).

    Raises:
        ValueError: the file is missing, not UTF-8 text or not YAML, not a mapping, or names a field `cls` does not
            have.
    """
    cls = EvalConfig if cls is None else cls
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except (FileNotFoundError, IsADirectoryError) as exc:
        what = "a directory" if isinstance(exc, IsADirectoryError) else "no such file"
        raise ValueError(f"--config {path}: {what}; give the path of a YAML file of settings, e.g. "
                         "eval/configs/wikitext2-2048.yaml.") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path}: not a UTF-8 text file; give a YAML file of settings.") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}.")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown settings {unknown}; allowed: {sorted(known)}.")
    return data


_HELP = {
    "task": f"one of {', '.join(TASKS)}",
    "model": "transformers id, local directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    "dtype": f"model dtype, one of {', '.join(DTYPES)}",
    "device": "auto (the process's accelerate device), cpu or cuda",
    "num_threads": "torch CPU threads per process, 0 for torch's default (1 is faster on a busy machine)",
    "dataset": "local .txt/.raw/.json/.jsonl file or directory, or a datasets name (default: "
               + ", ".join(f"{path} for {task}" for task, path in TASK_DATASETS.items()) + ")",
    "dataset_config": "datasets config name (e.g. wikitext-2-raw-v1)",
    "split": "datasets split",
    "text_field": "column holding the text in JSON/JSONL/datasets rows",
    "data_dir": "folder relative dataset paths start from (default: $HF_PAGEDKV_DATA_DIR or eval/data in the package)",
    "num_windows": "windows (perplexity) or examples (summarization)",
    "prefill_len": "tokens prefilled before scoring (perplexity); longest prompt (summarization)",
    "score_len": "tokens decoded one at a time through the cache and scored (perplexity)",
    "gen_len": "greedy continuation length (perplexity); longest summary (summarization)",
    "block_size": "PagedCache tokens per block (default: PagedCache's own)",
    "qc_group_size": "QuantizedCache q_group_size of the reference columns",
    "qc_residual_length": "QuantizedCache full-precision residual window (tokens)",
    "seed": "seed set before every pass",
    "output_dir": "parent folder of run directories",
    "run_name": "run directory name (default: derived from the settings)",
    "overwrite": "redo a finished run instead of skipping it",
}


def _with_default(f) -> str:
    """A flag's help: the field's help, then its default, unless the help already says it or there is none."""
    text = _HELP[f.name]
    if "default:" in text or f.default is None:
        return text
    return f"{text} (default: {f.default})"


def build_parser(prog: str = "python -m eval.drift") -> argparse.ArgumentParser:
    """The `python -m eval.drift` / `hf-pagedkv eval` parser: `--config FILE` plus one flag per `EvalConfig` field.
    Flags default to "not given" so that only what the user typed overrides the file.

    Args:
        prog (`str`, defaults to `"python -m eval.drift"`): the command shown in the usage line.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Drift of PagedCache quantization configs (and transformers' QuantizedCache) against the "
                    "unquantized DynamicCache baseline, on a dataset.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", dest="config_file", help="YAML file of settings (CLI flags override it)")
    for f in fields(EvalConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            parser.add_argument(flag, dest=f.name, action="store_true", help=_HELP[f.name])
        elif f.name == "configs":
            parser.add_argument(flag, dest=f.name, nargs="+", metavar="NAME",
                                help=f"cache configs to compare, from {', '.join(PAGED_CONFIGS + REFERENCE_CONFIGS)}"
                                     f" (default: {' '.join(DEFAULT_CONFIGS)})")
        elif f.type in ("int", "int | None"):
            parser.add_argument(flag, dest=f.name, type=int, help=_with_default(f))
        else:
            parser.add_argument(flag, dest=f.name, help=_with_default(f))
    parser.add_argument("-v", "--verbose", action="store_true", default=False)
    return parser


def resolve(argv: list[str] | None = None, base: EvalConfig | None = None,
            prog: str = "python -m eval.drift") -> tuple[EvalConfig, argparse.Namespace]:
    """Layer `base` (or the defaults), then `--config FILE`, then the other flags of `argv` (`prog`: the command
    named by `--help` and errors).

    Returns:
        `(EvalConfig, argparse.Namespace)`: the resolved config and the parsed arguments (for `--verbose`).

    Exits (argparse's usage error, status 2) on an unknown YAML key, an out-of-range setting or a missing local
    dataset file.
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    values = (base or EvalConfig()).to_dict()
    if getattr(args, "config_file", None):
        try:
            values.update(load_yaml(args.config_file))
        except ValueError as exc:
            parser.error(str(exc))
    names = {f.name for f in fields(EvalConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    if isinstance(values.get("configs"), list):  # `--configs fp,k8v4` as well as `--configs fp k8v4`
        values["configs"] = [c for item in values["configs"] for c in str(item).split(",") if c]
    try:
        cfg = EvalConfig(**values)
        from eval.data import resolve_local  # (eval.data imports this module)

        resolve_local(cfg)  # a local file named but missing: say so before the model loads
        return cfg, args
    except ValueError as exc:  # a setting out of range: argparse's usage error, not a traceback
        parser.error(str(exc))
