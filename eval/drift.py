"""`python -m eval.drift`: drift of cache configurations against the unquantized `DynamicCache` baseline.

One run evaluates every config in `EvalConfig.configs` and the baseline on the same examples, with the same seed,
and writes a run directory (`config.yaml`, `predictions.jsonl`, `metrics.json`, `report.md`, plots). A run whose
`metrics.json` exists is skipped; an interrupted run resumes after its last finished example (the raw records of
finished examples are kept under `partial/` until the run completes). Under `torchrun`/`accelerate launch` the
examples are sharded round-robin over the processes; raw per-example values are gathered and reduced once, so N
processes give the numbers of one.

Example:

```bash
python -m eval.drift --num-windows 2 --prefill-len 384 --score-len 128 --configs fp k8v4 quanto-int4
torchrun --nproc_per_node 2 -m eval.drift --config eval/configs/wikitext2-2048.yaml
```
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm
from transformers import set_seed

import hf_pagedkv

from . import caches
from .caches import BASELINE
from .config import EvalConfig, resolve
from .report import write_report
from .runner import continue_greedy, decode_teacher_forced, greedy, prefill
from .tasks.perplexity import metrics as ppl_metrics
from .tasks.perplexity import prepare as ppl_prepare
from .tasks.summarization import metrics as sum_metrics
from .tasks.summarization import prepare as sum_prepare

logger = logging.getLogger(__name__)

TASK_MODULES = {"perplexity": (ppl_prepare, ppl_metrics), "summarization": (sum_prepare, sum_metrics)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- one example -------------------------------------------------------------------------------------------------------
def _perplexity_pass(model, cfg: EvalConfig, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Teacher-forced logits `[score_len, vocab]` and the raw record of config `name` on one window `[1, len]`.

    The window's first `prefill_len` tokens are prefilled once; the greedy continuation runs on a snapshot of
    that cache (released before the teacher-forced decoding goes on, so the bytes counted are the latter's only).
    """
    set_seed(cfg.seed)
    cache = caches.build(name, cfg, model.config)
    written = caches.record_writes(cache) if name != BASELINE else {}
    last_logits = prefill(model, cache, ids[:, : cfg.prefill_len])
    branch = caches.snapshot(cache)
    gen = continue_greedy(model, branch, last_logits, cfg.gen_len)
    caches.release(branch)
    del branch
    logits = decode_teacher_forced(model, cache, ids, cfg.prefill_len)
    record = {"gen": gen, "bytes": caches.bytes_held(cache), "tokens": cfg.prefill_len + cfg.score_len}
    terms = {"k_sq_err": [], "k_sq_ref": [], "v_sq_err": [], "v_sq_ref": []}
    for layer_idx in sorted(written):
        keys, values = caches.read_back(cache, layer_idx)
        chunks = written[layer_idx]
        for kv, got, want in (("k", keys, torch.cat([c[0] for c in chunks], dim=-2)),
                              ("v", values, torch.cat([c[1] for c in chunks], dim=-2))):
            err, ref = ppl_metrics.error_terms(want, got)
            terms[f"{kv}_sq_err"].append(err)
            terms[f"{kv}_sq_ref"].append(ref)
    caches.release(cache)
    record.update(terms)
    return logits, record


def _perplexity_example(model, tokenizer, cfg: EvalConfig, example: dict, names: list[str], bar) -> list[dict]:
    ids = torch.tensor([example["ids"]], dtype=torch.long, device=model.device)  # [1, prefill + score + 1]
    targets = ids[0, cfg.prefill_len + 1:]  # [score_len]
    bar.set_postfix_str(f"window {example['example']}: {BASELINE}")
    base_logits, base = _perplexity_pass(model, cfg, BASELINE, ids)
    base["nll"] = ppl_metrics.token_nll(base_logits, targets).cpu().numpy()
    out = [dict(base, example=example["example"], config=BASELINE, start=example["start"])]
    bar.update()
    for name in names:
        bar.set_postfix_str(f"window {example['example']}: {name}")
        logits, rec = _perplexity_pass(model, cfg, name, ids)
        rec["nll"] = ppl_metrics.token_nll(logits, targets).cpu().numpy()
        rec["kl"] = ppl_metrics.token_kl(base_logits, logits).cpu().numpy()
        rec["top1"] = ppl_metrics.top1_match(base_logits, logits).cpu().numpy()
        rec["gen_match"], rec["first_div"] = ppl_metrics.greedy_agreement(base["gen"], rec["gen"])
        out.append(dict(rec, example=example["example"], config=name, start=example["start"]))
        bar.update()
    return out


def _eos_ids(model, tokenizer) -> list[int] | None:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return None if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _summarization_example(model, tokenizer, cfg: EvalConfig, example: dict, names: list[str], bar) -> list[dict]:
    prompt = torch.tensor([example["ids"]], dtype=torch.long, device=model.device)  # [1, prompt_len]
    eos = _eos_ids(model, tokenizer)
    out, base = [], None
    for name in [BASELINE] + names:
        bar.set_postfix_str(f"example {example['example']}: {name}")
        set_seed(cfg.seed)
        cache = caches.build(name, cfg, model.config)
        tokens = greedy(model, cache, prompt, cfg.gen_len, eos)
        rec = {"example": example["example"], "config": name, "gen": tokens, "bytes": caches.bytes_held(cache),
               "tokens": cache.get_seq_length(), "summary": tokenizer.decode(tokens, skip_special_tokens=True).strip()}
        caches.release(cache)
        rec["rougeL_vs_reference"] = sum_metrics.rouge_l(rec["summary"], example["reference"])
        if base is None:
            base = rec
        else:
            rec["rougeL_vs_baseline"] = sum_metrics.rouge_l(rec["summary"], base["summary"])
            rec["gen_match"], rec["first_div"] = ppl_metrics.greedy_agreement(base["gen"], tokens)
        out.append(rec)
        bar.update()
    return out


# -- the run -----------------------------------------------------------------------------------------------------------
def _state(cfg: EvalConfig):
    from accelerate import PartialState

    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    return PartialState(cpu=cpu)


def _gather(records: list[dict], state) -> list[dict]:
    if state.num_processes == 1:
        return records
    from accelerate.utils import gather_object

    return gather_object(records)


def reduce_records(cfg: EvalConfig, records: list[dict], unavailable: dict[str, str]) -> dict:
    """`metrics.json`'s `baseline` and `configs` entries from the raw records of every example (any order)."""
    _, task_metrics = TASK_MODULES[cfg.task]
    by_config: dict[str, list[dict]] = {}
    for rec in sorted(records, key=lambda r: r["example"]):
        by_config.setdefault(rec["config"], []).append(rec)
    baseline = by_config[BASELINE]
    out = {"baseline": task_metrics.reduce_baseline(baseline), "configs": {}}
    for name in cfg.configs:
        if name in unavailable:
            out["configs"][name] = {"status": unavailable[name]}
        else:
            out["configs"][name] = dict(task_metrics.reduce(by_config[name], baseline), status="ok")
    return out


def _environment(state, seconds: float) -> dict:
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "hf_pagedkv": hf_pagedkv.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "num_processes": state.num_processes,
        "device": str(state.device), "seconds": round(seconds, 1),
    }


def _prediction_lines(cfg: EvalConfig, records: list[dict], examples: list[dict], tokenizer) -> list[dict]:
    """One JSON line per (example, config): the texts and per-example values (per-position KL rounded to 4 digits)."""
    lines = []
    refs = {ex["example"]: ex for ex in examples}
    order = {name: i for i, name in enumerate([BASELINE] + list(cfg.configs))}
    for rec in sorted(records, key=lambda r: (r["example"], order[r["config"]])):
        line = {"example": rec["example"], "config": rec["config"]}
        if cfg.task == "perplexity":
            line.update(start=rec["start"], ppl=float(np.exp(np.mean(rec["nll"]))),
                        bytes_per_token=rec["bytes"] / rec["tokens"],
                        continuation=tokenizer.decode(rec["gen"], skip_special_tokens=True))
            if rec["config"] != BASELINE:
                line.update(kl_mean=float(np.mean(rec["kl"])), top1=float(np.mean(rec["top1"])),
                            gen_match=rec["gen_match"], first_div=rec["first_div"],
                            kl=[float(f"{x:.4g}") for x in rec["kl"]])
        else:
            line.update(summary=rec["summary"], rougeL_vs_reference=rec["rougeL_vs_reference"],
                        bytes_per_token=rec["bytes"] / rec["tokens"])
            if rec["config"] == BASELINE:
                ex = refs[rec["example"]]
                line.update(query=ex["query"], reference=ex["reference"], prompt_tokens=len(ex["ids"]))
            else:
                line.update(rougeL_vs_baseline=rec["rougeL_vs_baseline"], gen_match=rec["gen_match"],
                            first_div=rec["first_div"])
        lines.append(line)
    return lines


def _partial_path(partial: Path, example: int) -> Path:
    return partial / f"example-{example:05d}.pkl"


def _load_partial(partial: Path, example: int, names: list[str]) -> list[dict] | None:
    """The records an interrupted run saved for `example`, if they cover exactly the configs run now."""
    path = _partial_path(partial, example)
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        records = pickle.load(fh)  # our own file, written by `_save_partial` for this run directory
    return records if {r["config"] for r in records} == {BASELINE, *names} else None


def _save_partial(partial: Path, example: int, records: list[dict]) -> None:
    """Keep one example's records, so that an interrupted run resumes after its last finished example."""
    partial.mkdir(parents=True, exist_ok=True)
    path = _partial_path(partial, example)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        pickle.dump(records, fh)
    os.replace(tmp, path)  # atomic: a killed run never leaves a half-written file under the final name


def run(cfg: EvalConfig, model=None, tokenizer=None) -> dict:
    """Evaluate every config of `cfg` against the baseline and write the run directory (main process).

    Args:
        cfg (`EvalConfig`): the settings.
        model, tokenizer (*optional*): an already loaded model and tokenizer; loaded from `cfg.model` otherwise.

    Returns:
        `dict`: the content of `metrics.json` (also for a finished run, which is skipped).

    Raises:
        ValueError: bad settings or data (see `EvalConfig`, `eval.data`).
    """
    run_dir = cfg.run_dir()
    metrics_path = run_dir / "metrics.json"
    if metrics_path.exists() and not cfg.overwrite:
        logger.info("skipping finished run %s (pass --overwrite to redo it)", run_dir)
        return json.loads(metrics_path.read_text())
    state = _state(cfg)
    start = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if model is None:
        from hf_pagedkv.tools.models import load_model

        model, tokenizer = load_model(cfg.model, dtype=_DTYPES[cfg.dtype], device=str(state.device))
    task_prepare, _ = TASK_MODULES[cfg.task]
    examples = task_prepare.load_examples(cfg, tokenizer)
    unavailable = {}
    for name in cfg.configs:
        reason = caches.unavailable_reason(name, cfg, model.config)
        if reason is not None:
            unavailable[name] = reason
            if state.is_main_process:
                logger.warning("%s: %s", name, reason)
    names = [n for n in cfg.configs if n not in unavailable]
    mine = examples[state.process_index:: state.num_processes]
    per_example = _perplexity_example if cfg.task == "perplexity" else _summarization_example
    partial = run_dir / "partial"
    if cfg.overwrite and state.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    state.wait_for_everyone()
    records: list[dict] = []
    with tqdm(total=len(mine) * (1 + len(names)), desc=f"{cfg.task} drift", unit="pass",
              disable=not state.is_main_process) as bar:
        for example in mine:
            done = _load_partial(partial, example["example"], names)
            if done is None:
                done = per_example(model, tokenizer, cfg, example, names, bar)
                _save_partial(partial, example["example"], done)
            else:
                bar.update(1 + len(names))
            records.extend(done)
    records = _gather(records, state)
    metrics = None
    if state.is_main_process:
        metrics = {"task": cfg.task, "run": run_dir.name, **reduce_records(cfg, records, unavailable)}
        metrics["environment"] = _environment(state, time.perf_counter() - start)
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = dict(cfg.to_dict(), dataset=cfg.dataset_name, data_dir=str(cfg.resolved_data_dir))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        with open(run_dir / "predictions.jsonl", "w", encoding="utf-8") as fh:
            for line in _prediction_lines(cfg, records, examples, tokenizer):
                fh.write(json.dumps(line, ensure_ascii=False) + "\n")
        write_report(run_dir, cfg, metrics)
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")  # last: its presence marks the run finished
        shutil.rmtree(partial, ignore_errors=True)
        logger.info("wrote %s", run_dir)
    state.wait_for_everyone()
    if metrics is None:
        metrics = json.loads(metrics_path.read_text())
    return metrics


def main(argv: list[str] | None = None, prog: str = "python -m eval.drift") -> int:
    """Command-line entry point (`python -m eval.drift`, `hf-pagedkv eval`, whose `prog` names it in `--help`);
    prints the report's table."""
    cfg, args = resolve(argv, prog=prog)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    metrics = run(cfg)
    if _is_main():
        report = Path(cfg.run_dir()) / "report.md"
        text = report.read_text()
        table = text.split("<!-- table -->")[1] if "<!-- table -->" in text else text
        sys.stdout.write(table.strip() + f"\n\nrun directory: {cfg.run_dir()}\n")
    return 0 if metrics else 1


def _is_main() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


if __name__ == "__main__":
    sys.exit(main())
