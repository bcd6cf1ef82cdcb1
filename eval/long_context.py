"""`python -m eval.long_context`: what retention policies cost on long contexts.

Two tasks, each writing a run directory (`config.yaml`, `predictions.jsonl`, `metrics.json`, `report.md`, a plot)
named from its settings; a finished run is skipped (`--overwrite` redoes it):

- **perplexity**: streaming perplexity beyond the budget. Each WikiText window of `context_len` tokens is fed
  through the cache in chunks of `chunk` tokens; every `score_stride`-th chunk that starts after `budget` tokens is
  scored (the same tokens for every method). Methods: `full` (no eviction), `sink_window` (StreamingLLM:
  `SinkWindow(sink_tokens, window=budget - block_size)`, one sink block plus the window), `window_only`
  (`SinkWindow(0, budget)`), `key_norm` / `key_diff` (`KeyNorm` / `KeyDiff(budget=budget)`), and `recompute`,
  StreamingLLM's reference "sliding window with recomputation": each scored chunk is computed without a cache from
  exactly the first `sink_tokens` tokens and its last ``budget - sink_tokens`` tokens, at their true positions.
- **passkey**: a seeded passkey hidden in a local haystack (`eval/tasks/passkey`), the question appended after
  the compressed context; accuracy per method and compression ratio against the uncompressed `full` cache. Methods:
  `full`, `sink_window`, `key_norm`, `key_diff` and `snap_kv` (`SnapKV`, query-aware: the model runs with
  ``attn_implementation="hf_pagedkv"`` for the whole task, so every method reads through the same attention),
  `pyramid_kv` (`PyramidKV`, the same scores with budgets shrinking with depth; its tiers are layer groups of their
  own, so it computes the context itself instead of attaching to the shared one) and
  `kv_zip` (`KVzip`, query-agnostic: after the context's prefill, `compress_context` runs its reconstruction pass
  and compresses; then the question comes as the next step) and `kv_zip_recent` (the same with H2O's split: a
  `recent_share` of each head's kept tokens goes to the most recent context tokens, the scores choose the rest) and
  `kv_zip_pooled` (the same with its scores max-pooled, or `kv_zip_pooling`, over `kv_zip_kernel` tokens, so a
  kept token keeps its neighbours; `kv_zip_recent_share`, 0 by default, gives it H2O's split too) and
  `kv_zip_global` (`kv_zip_pooled` with KVzip's ranking across layers, `KVzipScoring(layer_budgets="global")`:
  each layer keeps what its heads hold of the best-scored tokens of all layers; its layers are tiers, layer groups of
  their own, so it computes the context itself as `pyramid_kv` does); `kv_zip_share_heads` makes both keep the same
  tokens in every KV head of a layer (`KVzipScoring(share_heads=True)`), and `kv_zip_value_weighted` weighs each
  token's score by its value's norm (`KVzipScoring(value_weighted=True)`).
  Each example's context is computed once and published in a prefix-caching pool; every method's cache attaches
  to it and computes the last ``recent_tokens``-plus tokens itself (SnapKV's observation window), then compresses
  the whole context before the question, exactly as after a one-step prefill.

Example:

```bash
python -m eval.long_context --num-windows 2 --context-len 2048 --budgets 512
python -m eval.long_context --task passkey --contexts 1024 --ratios 0.5 --num-keys 2
```
"""

from __future__ import annotations

import json
import logging
import math
import platform
import sys
import time
from pathlib import Path

import torch
import yaml
from transformers import set_seed

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs, compress_context
from hf_pagedkv.retention import KVzip, KVzipScoring, KeyDiff, KeyNorm, PyramidKV, SinkWindow, SnapKV

from .config import EvalConfig
from .data import load_text, tokenize_prefix
from .long_context_config import POOLED_METHODS, LongContextConfig, resolve
from .tasks.passkey import metrics as passkey_metrics
from .tasks.passkey import prepare as passkey_prepare
from .tasks.perplexity.metrics import token_nll

logger = logging.getLogger(__name__)


# -- caches ------------------------------------------------------------------------------------------------------------
def policy_for(method: str, cfg: LongContextConfig, budget: int | None = None, ratio: float | None = None,
               context: int | None = None):
    """The retention policy of `method` for a token `budget` (perplexity) or a compression `ratio` of a `context`
    of that many tokens (passkey); None for `full`."""
    if method == "full":
        return None
    if ratio is not None:
        budget = max(cfg.sink_tokens + cfg.recent_tokens + 1, int(context * (1 - ratio)))
    if method == "sink_window":
        return SinkWindow(sink_tokens=cfg.sink_tokens, window=max(1, budget - cfg.block_size))
    if method == "window_only":
        return SinkWindow(sink_tokens=0, window=budget)
    cls = {"key_norm": KeyNorm, "key_diff": KeyDiff, "snap_kv": SnapKV, "pyramid_kv": PyramidKV,
           "kv_zip": KVzip, "kv_zip_recent": KVzip, "kv_zip_pooled": KVzip, "kv_zip_global": KVzip}[method]
    pooled = {"kernel_size": cfg.kv_zip_kernel, "pooling": cfg.kv_zip_pooling, "share_heads": cfg.kv_zip_share_heads,
              "value_weighted": cfg.kv_zip_value_weighted, "value_power": cfg.kv_zip_value_power}
    extra = {"kv_zip": {"scoring": "plain"}, "kv_zip_recent": {"recent_share": cfg.recent_share, "scoring": "plain"},
             "kv_zip_pooled": {"recent_share": cfg.kv_zip_recent_share, "scoring": KVzipScoring(**pooled)},
             "kv_zip_global": {"recent_share": cfg.kv_zip_recent_share, "scoring": KVzipScoring(
                 **pooled, layer_budgets="global", safeguard=cfg.kv_zip_safeguard)}}.get(method, {})
    if ratio is not None:
        return cls(compression_ratio=ratio, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens, **extra)
    return cls(budget=budget, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens, **extra)


# -- streaming perplexity ----------------------------------------------------------------------------------------------
def scored_chunks(cfg: LongContextConfig, budget: int) -> list[int]:
    """Start offsets of the chunks scored at this budget: after the budget, every `score_stride`-th, each with a
    next token to predict after it."""
    starts = [s for s in range(0, cfg.context_len, cfg.chunk) if s >= budget and s + cfg.chunk < cfg.context_len]
    return starts[:: cfg.score_stride]


@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, cache: PagedCache, cfg: LongContextConfig, scored: list[int]) -> dict:
    """Feed window `ids` `[1, n]` through `cache` chunk by chunk; NLL of the scored chunks' next tokens."""
    nll, want = [], set(scored)
    for s in range(0, ids.shape[1] - 1, cfg.chunk):
        out = model(ids[:, s: s + cfg.chunk], **cache_kwargs(cache))
        if s in want:
            nll.append(token_nll(out.logits[0], ids[0, s + 1: s + cfg.chunk + 1]))
    stats = cache.pool.stats()
    held = cache.retention_stats()
    return {"nll": torch.cat(nll).tolist(), "bytes_in_use": stats.bytes_in_use, "tokens_held": held.tokens_held,
            "tokens_seen": held.tokens_seen}


@torch.no_grad()
def recompute_nll(model, ids: torch.Tensor, cfg: LongContextConfig, budget: int, scored: list[int]) -> dict:
    """StreamingLLM's sliding window with recomputation: each scored chunk computed without a cache from the first
    `sink_tokens` tokens and the ``budget - sink_tokens`` tokens before it, at their true positions."""
    S, nll = cfg.sink_tokens, []
    for s in scored:
        lo = max(S, s - (budget - S))
        positions = torch.cat([torch.arange(S), torch.arange(lo, s + cfg.chunk)])  # [S + (s - lo) + chunk]
        out = model(ids[:, positions], position_ids=positions[None].to(ids.device), use_cache=False)
        nll.append(token_nll(out.logits[0, -cfg.chunk:], ids[0, s + 1: s + cfg.chunk + 1]))
    return {"nll": torch.cat(nll).tolist(), "bytes_in_use": None, "tokens_held": budget, "tokens_seen": None}


def columns(cfg: LongContextConfig) -> list[tuple[str, str]]:
    """`(method, quant)` pairs of a perplexity run: every method in full precision, then each cache method in each
    other KV format of `quants` (the recomputation reference has no cache to quantize)."""
    return [(m, q) for q in cfg.quants for m in cfg.methods if q == "fp" or m != "recompute"]


def run_perplexity(model, tokenizer, cfg: LongContextConfig) -> tuple[list[dict], dict]:
    data_cfg = EvalConfig(dataset=cfg.dataset, data_dir=cfg.data_dir)
    ids = tokenize_prefix(load_text(data_cfg), tokenizer, cfg.context_len * cfg.num_windows)
    if len(ids) < cfg.context_len * cfg.num_windows:
        raise ValueError(f"{cfg.dataset!r} has {len(ids)} tokens: fewer than num_windows * context_len.")
    records = []
    for w in range(cfg.num_windows):
        window = torch.tensor([ids[w * cfg.context_len: (w + 1) * cfg.context_len]], device=model.device)
        for budget in cfg.budgets:
            scored = scored_chunks(cfg, budget)
            for method, quant in columns(cfg):
                set_seed(cfg.seed)
                t0 = time.perf_counter()
                if method == "recompute":
                    rec = recompute_nll(model, window, cfg, budget, scored)
                else:
                    cache = PagedCache(block_size=cfg.block_size, config=model.config, quant=quant,
                                       retention=policy_for(method, cfg, budget))
                    rec = stream_nll(model, window, cache, cfg, scored)
                    cache.release()
                name = method if quant == "fp" else f"{method}+{quant}"
                rec.update(window=w, budget=budget, method=name, seconds=round(time.perf_counter() - t0, 2))
                logger.info("window %d budget %d %s: ppl %.3f (%.1f s)", w, budget, name,
                            math.exp(sum(rec["nll"]) / len(rec["nll"])), rec["seconds"])
                records.append(rec)
    table = {}
    for budget in cfg.budgets:
        row = {}
        for method in dict.fromkeys(r["method"] for r in records):
            recs = [r for r in records if r["budget"] == budget and r["method"] == method]
            nll = [x for r in recs for x in r["nll"]]
            held = [r["bytes_in_use"] for r in recs if r["bytes_in_use"] is not None]
            row[method] = {"ppl": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll),
                           "bytes_in_use": max(held) if held else None,
                           "tokens_held": max(r["tokens_held"] for r in recs)}
        table[str(budget)] = row
    return records, {"perplexity": table}


# -- passkey -----------------------------------------------------------------------------------------------------------
def prompt_of(example: dict, cfg: LongContextConfig) -> list[int]:
    """What the cache is given before compressing: the context, or the context and the question
    (`question_in_prompt`)."""
    return example["context_ids"] + (example["question_ids"] if cfg.question_in_prompt else [])


@torch.no_grad()
def prefill(model, tokenizer, cache: PagedCache, example: dict, cfg: LongContextConfig):
    """Prefill what `cache` does not hold of the prompt in one step; with a `KVzip` policy, then compress the
    context (its reconstruction pass). The prefill's model output."""
    prompt = prompt_of(example, cfg)
    out = model(torch.tensor([prompt[cache.get_seq_length():]], device=model.device), **cache_kwargs(cache))
    if isinstance(cache.retention_policy, KVzip):  # query-agnostic: a reconstruction pass scores the context
        compress_context(model, cache, prompt, tokenizer=tokenizer)
    return out


@torch.no_grad()
def answer(model, tokenizer, cache: PagedCache, example: dict, cfg: LongContextConfig,
           max_new_tokens: int = 8, prefilled=None) -> tuple[str, dict]:
    """`prefill` (unless `prefilled`, its output for this cache, is given); unless the question is in the prompt,
    append it as the next step (the cache compresses the context before it); decode greedily (with the question in
    the prompt, the cache compresses before the first decoded token). The answer text and what the cache held after
    the question."""
    dev = model.device
    out = prefill(model, tokenizer, cache, example, cfg) if prefilled is None else prefilled
    if not cfg.question_in_prompt:
        out = model(torch.tensor([example["question_ids"]], device=dev), **cache_kwargs(cache))
    tokens = []
    for i in range(max_new_tokens):
        nxt = out.logits[0, -1].argmax().item()
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]], device=dev), **cache_kwargs(cache))
        if i == 0:
            held = cache.retention_stats()  # with the question in the prompt, its compression ran at this step
    held = {"tokens_held": held.tokens_held - 1,  # before the first generated token
            "bytes_in_use": cache.pool.stats().bytes_in_use}
    return tokenizer.decode(tokens, skip_special_tokens=True), held


@torch.no_grad()
def shared_context(model, cfg: LongContextConfig, context: list[int]) -> BlockPool:
    """A prefix-caching pool holding the K/V of `context` (published, no cache holding it): each method attaches
    to it instead of computing the context again."""
    pool = BlockPool(block_size=cfg.block_size, prefix_caching=True)
    base = PagedCache(pool=pool, config=model.config)
    model(torch.tensor([context], device=model.device), **cache_kwargs(base))
    base.publish([context], model=model)
    base.release()
    return pool


def run_passkey(model, tokenizer, cfg: LongContextConfig) -> tuple[list[dict], dict]:
    text = load_text(EvalConfig(dataset=cfg.dataset, data_dir=cfg.data_dir))
    examples = passkey_prepare.make_examples(cfg, tokenizer, text)
    records = []
    before = model.config._attn_implementation
    # they get queries from this attention; so does all
    if {"snap_kv", "pyramid_kv", "kv_zip", "kv_zip_recent", "kv_zip_pooled", "kv_zip_global"} & set(cfg.methods):
        model.set_attn_implementation("hf_pagedkv")
    try:
        for ex in examples:
            ctx = prompt_of(ex, cfg)
            pool = shared_context(model, cfg, ctx)
            for method in cfg.methods:
                for ratio in ([None] if method == "full" else cfg.ratios):
                    set_seed(cfg.seed)
                    policy = policy_for(method, cfg, ratio=ratio, context=len(ctx))
                    # the last `recent_tokens` (and more, to a block boundary) are computed by the method's cache:
                    # SnapKV's observation window needs their queries
                    # a tiered policy's tiers are layer groups of their own: it computes the context
                    if policy is not None and policy.is_tiered():
                        cache = PagedCache(pool=BlockPool(block_size=cfg.block_size), config=model.config,
                                           retention=policy)
                    else:
                        cache = PagedCache.from_prefix(pool, ctx[: max(1, len(ctx) - cfg.recent_tokens)],
                                                       model=model, retention=policy)
                    text_out, held = answer(model, tokenizer, cache, ex, cfg)
                    cache.release()
                    records.append(dict(held, example=ex["example"], context_len=ex["context_len"],
                                        depth=ex["depth"], key=ex["key"], method=method, ratio=ratio,
                                        answer=text_out, correct=passkey_metrics.is_correct(text_out, ex["key"])))
            logger.info("passkey example %d done", ex["example"])
    finally:
        model.set_attn_implementation(before)
    table = {}
    for method in cfg.methods:
        for ratio in ([None] if method == "full" else cfg.ratios):
            recs = [r for r in records if r["method"] == method and r["ratio"] == ratio]
            table[f"{method}@{ratio}" if ratio is not None else method] = {
                "method": method, "ratio": ratio, "accuracy": passkey_metrics.accuracy(recs), "examples": len(recs),
                "by_depth": {str(d): passkey_metrics.accuracy([r for r in recs if r["depth"] == d])
                             for d in cfg.depths}}
    return records, {"passkey": table}


# -- report ------------------------------------------------------------------------------------------------------------
def report_text(cfg: LongContextConfig, metrics: dict) -> str:
    pooled = [m for m in cfg.methods if m in POOLED_METHODS]
    lines = [f"# Long contexts: {cfg.task}", "", f"Model: {cfg.model or 'SmolLM2-135M-Instruct (bundled GGUF)'}; "
             f"data: `{cfg.dataset}`; block size {cfg.block_size}; sinks {cfg.sink_tokens}, recent tokens "
             f"{cfg.recent_tokens}"
             + (f"; kv_zip_recent: recent share {cfg.recent_share}" if "kv_zip_recent" in cfg.methods else "")
             + (f"; {'/'.join(pooled)}: kernel "
                f"{cfg.kv_zip_kernel}" if pooled else "")
             + (f", {cfg.kv_zip_pooling}-pooling" if pooled and cfg.kv_zip_pooling != "max" else "")
             + (f", recent share {cfg.kv_zip_recent_share}" if pooled and cfg.kv_zip_recent_share else "")
             + (", heads share their tokens" if pooled and cfg.kv_zip_share_heads else "")
             + (", scores weighted by value norms" if pooled and cfg.kv_zip_value_weighted else "")
             + (f" to the power {cfg.kv_zip_value_power}" if pooled and cfg.kv_zip_value_power != 1 else "")
             + (f"; kv_zip_global: safeguard {cfg.kv_zip_safeguard}" if "kv_zip_global" in cfg.methods
                and cfg.kv_zip_safeguard else "")
             + f"; {metrics['environment']['seconds']} s.", ""]
    if cfg.task == "perplexity":
        lines += [f"{cfg.num_windows} windows of {cfg.context_len} tokens fed in chunks of {cfg.chunk}; 1 in "
                  f"{cfg.score_stride} chunks after the budget scored (the same tokens for every method). KV bytes "
                  "and tokens held at the end of the stream (the last chunk included).", "", "<!-- table -->",
                  "| budget | method | ppl | vs full | vs recompute | KV bytes held | tokens held |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for budget, row in metrics["perplexity"].items():
            full, ref = row.get("full", {}).get("ppl"), row.get("recompute", {}).get("ppl")
            for method, m in row.items():
                rel = (lambda base: f"{100 * (m['ppl'] / base - 1):+.1f}%" if base else "-")
                held = f"{m['bytes_in_use'] / 2**20:.1f} MiB" if m["bytes_in_use"] is not None else "-"
                lines.append(f"| {budget} | {method} | {m['ppl']:.3f} | {rel(full)} | {rel(ref)} | {held} | "
                             f"{m['tokens_held']} |")
        if any(q != "fp" for q in cfg.quants):
            lines += ["<!-- table -->", "", "Memory-matched: every cache column by the bytes it holds (eviction, "
                      "quantization, both).", "", "| budget | method | KV bytes held | ppl | vs full |",
                      "| ---: | --- | ---: | ---: | ---: |"]
            for budget, row in metrics["perplexity"].items():
                full = row["full"]["ppl"] if "full" in row else None
                for method, m in sorted(((k, v) for k, v in row.items() if v["bytes_in_use"] is not None),
                                        key=lambda kv: kv[1]["bytes_in_use"]):
                    rel = f"{100 * (m['ppl'] / full - 1):+.1f}%" if full else "-"
                    lines.append(f"| {budget} | {method} | {m['bytes_in_use'] / 2**20:.1f} MiB | {m['ppl']:.3f} | "
                                 f"{rel} |")
    else:
        lines += [f"Contexts {cfg.contexts} tokens, depths {cfg.depths}%, {cfg.num_keys} keys each.", "",
                  "<!-- table -->", "| method | ratio | accuracy | " + " | ".join(f"depth {d}%" for d in cfg.depths)
                  + " |", "| --- | ---: | ---: | " + " | ".join("---:" for _ in cfg.depths) + " |"]
        for m in metrics["passkey"].values():
            lines.append(f"| {m['method']} | {m['ratio'] if m['ratio'] is not None else '-'} | {m['accuracy']:.2f} | "
                         + " | ".join(f"{m['by_depth'][str(d)]:.2f}" for d in cfg.depths) + " |")
    lines += ["<!-- table -->", ""]
    if cfg.task == "passkey":
        lines += ["The question " + ("was part of the prompt, compressed with it before the first generated token "
                                     "(SnapKV's setting: the observation window holds the question)."
                                     if cfg.question_in_prompt else
                                     "was appended as a new forward step after the context was compressed "
                                     "(kvpress's convention: the compression cannot know the question)."), ""]
    return "\n".join(lines)


def write_plot(run_dir: Path, cfg: LongContextConfig, metrics: dict) -> str | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    if cfg.task == "perplexity":
        for budget, row in metrics["perplexity"].items():
            for method, m in row.items():
                if m["bytes_in_use"] is not None:
                    ax.scatter(m["bytes_in_use"] / 2**20, m["ppl"], label=f"{method} ({budget})")
                    ax.annotate(method, (m["bytes_in_use"] / 2**20, m["ppl"]), fontsize=6)
                else:  # the recomputation reference holds no cache
                    ax.axhline(m["ppl"], color="grey", ls="--", lw=0.8, label=f"{method} ({budget})")
        ax.set(xlabel="KV MiB held at the end of the stream", ylabel="perplexity beyond the budget", yscale="log",
               title=f"streaming perplexity vs memory, {cfg.context_len}-token windows")
        name = "perplexity.png"
    else:
        for method in cfg.methods:
            ms = [m for m in metrics["passkey"].values() if m["method"] == method]
            if method == "full":
                ax.axhline(ms[0]["accuracy"], color="k", ls="--", label="full")
            else:
                ax.plot([m["ratio"] for m in ms], [m["accuracy"] for m in ms], marker="o", label=method)
        ax.set(xlabel="compression ratio (fraction removed)", ylabel="passkey accuracy", ylim=(-0.05, 1.05))
        name = "passkey.png"
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / name, dpi=100)
    return name


def run(cfg: LongContextConfig, model=None, tokenizer=None) -> dict:
    """Run the task of `cfg` and write its run directory; a finished run is read back instead.

    Returns:
        `dict`: the content of `metrics.json`.
    """
    run_dir = cfg.run_dir()
    metrics_path = run_dir / "metrics.json"
    if metrics_path.exists() and not cfg.overwrite:
        logger.info("skipping finished run %s (pass --overwrite to redo it)", run_dir)
        return json.loads(metrics_path.read_text())
    start = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if model is None:
        from hf_pagedkv.tools.models import load_model

        model, tokenizer = load_model(cfg.model)
    records, metrics = (run_perplexity if cfg.task == "perplexity" else run_passkey)(model, tokenizer, cfg)
    metrics = {"task": cfg.task, "run": run_dir.name, **metrics, "environment": {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "hf_pagedkv": hf_pagedkv.__version__,
        "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - start, 1)}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    with open(run_dir / "predictions.jsonl", "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    plot = write_plot(run_dir, cfg, metrics)
    (run_dir / "report.md").write_text(report_text(cfg, metrics) + (f"\n![{plot}]({plot})\n" if plot else ""))
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")  # last: its presence marks the run finished
    return metrics


def main(argv: list[str] | None = None) -> int:
    cfg, args = resolve(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    run(cfg)
    text = (cfg.run_dir() / "report.md").read_text()
    sys.stdout.write(text.split("<!-- table -->")[1].strip() + f"\n\nrun directory: {cfg.run_dir()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
