"""One command for the numbers: PagedCache (fp and quantized) against DynamicCache on the real model, as ratios.

    python benchmarks/run.py            # full run (~15-25 min on 2 CPU cores), writes benchmarks/RESULTS.md + PNGs
    python benchmarks/run.py --quick    # smoke run (~3 min), writes benchmarks/quick/

Measured in one process, on SmolLM2-135M-Instruct (fp32, `hf_pagedkv.tools.models.load_model`) and WikiText-2 test text:

- decode tokens/s and KV bytes against context length (512 to 4096) for DynamicCache, PagedCache fp and every
  quantized preset the installed hf_pagedkv offers (`PagedCache(quant=...)`), with the planner's prediction;
- beam search (num_beams=4, 1024-token prompt, 32 new tokens) and parallel sampling (4 samples of a 1024-token
  prompt): time and KV bytes;
- prefix-hit time to first token (2048-token shared prefix + 32-token suffix) when prefix caching is available;
- the overhead of the metrics hooks, against the decode step time.

Every configuration is warmed up first, runs are interleaved across configurations and repeated (median), and
sampling is seeded. Decode throughput is timed on a greedy loop of `model(next_token, **cache_kwargs(cache))` after
an untimed prefill, so it measures the decode steps alone.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

_now = time.perf_counter  # the clock; `--clock cpu` switches to process CPU time (steadier on a shared machine)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eval.config import resolve_data_dir  # noqa: E402
import hf_pagedkv  # noqa: E402
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs  # noqa: E402
from hf_pagedkv.tools.models import load_model  # noqa: E402
from hf_pagedkv.tools.planning import PRESETS, ModelShape, plan_capacity  # noqa: E402
from hf_pagedkv.tools.verify import dynamic_cache_bytes  # noqa: E402

MiB = 2**20
DATA = resolve_data_dir() / "wikitext-2-raw" / "wiki.test.raw"  # eval/data, or $HF_PAGEDKV_DATA_DIR


# -- setup ---------------------------------------------------------------------------------------------------------
def describe_machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
        "memory": f"{ram:.1f} GiB RAM",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "software": f"Python {platform.python_version()}, torch {torch.__version__}, "
                    f"transformers {transformers.__version__}, {platform.platform()}",
        "hf_pagedkv": hf_pagedkv.__version__,
    }


def corpus_ids(tokenizer) -> torch.Tensor:
    """WikiText-2 test as one token stream (the whole file as one string)."""
    text = DATA.read_text(encoding="utf-8")
    return tokenizer(text[:200_000], return_tensors="pt").input_ids[0]


def quant_presets() -> list[str]:
    """The quantized presets `PagedCache(quant=...)` accepts in this checkout (none before quantization lands)."""
    if "quant" not in inspect.signature(PagedCache.__init__).parameters:
        return []
    ok = []
    for name in PRESETS:
        if name == "fp":
            continue
        try:
            PagedCache(quant=name).release()
            ok.append(name)
        except (ValueError, TypeError, ImportError) as e:
            print(f"  preset {name} skipped: {e}", flush=True)
    return ok


def make_cache(kind: str, model):
    """`kind` is "dynamic", "paged" (fp) or a quant preset name."""
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "paged":
        return PagedCache(config=model.config)
    return PagedCache(config=model.config, quant=kind)


def kv_bytes(cache) -> int:
    return dynamic_cache_bytes(cache) if isinstance(cache, DynamicCache) else cache.pool.stats().bytes_in_use


def release(cache) -> None:
    if isinstance(cache, PagedCache):
        cache.release()


# -- measurements ----------------------------------------------------------------------------------------------------
@torch.inference_mode()
def decode_run(model, prompt: torch.Tensor, kind: str, steps: int) -> dict:
    """Untimed prefill, then `steps` timed greedy decode steps; tokens/s, KV bytes at the end, and the tokens."""
    cache = make_cache(kind, model)
    out = model(prompt, **cache_kwargs(cache), logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    tokens = [token]
    t0 = _now()
    for _ in range(steps):
        out = model(token, **cache_kwargs(cache), logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    seconds = _now() - t0
    result = {"tok_s": steps / seconds, "step_ms": 1000 * seconds / steps, "bytes": kv_bytes(cache),
              "tokens": torch.cat(tokens, 1)}
    if isinstance(cache, PagedCache):
        result["p99_ms"] = 1000 * (cache.pool.metrics.snapshot().step_p99 or 0)
    release(cache)
    return result


@torch.inference_mode()
def generate_run(model, prompt: torch.Tensor, kind: str, new_tokens: int, seed: int, **gen) -> dict:
    """Time one `generate` call; KV bytes held at its end (and the paged pool's peak)."""
    cache = make_cache(kind, model)
    torch.manual_seed(seed)
    t0 = _now()
    out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         **gen)
    seconds = _now() - t0
    result = {"seconds": seconds, "bytes": kv_bytes(cache), "sequences": out}
    if isinstance(cache, PagedCache):
        result["peak_bytes"] = cache.pool.metrics.snapshot().peak_blocks_in_use * cache.pool.stats().bytes_per_block
    release(cache)
    return result


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def interleaved(configs: list[str], repeats: int, fn) -> dict[str, list[dict]]:
    """Run `fn(kind)` for every config, `repeats` rounds, interleaved so that load changes hit all alike."""
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(repeats):
        for kind in configs:
            runs[kind].append(fn(kind))
    return runs


def prefix_ttft(model, ids: torch.Tensor, prefix_len: int, suffix_len: int, repeats: int) -> dict | None:
    """Time to first token with a prefix hit vs without, when this checkout has prefix caching."""
    import hf_pagedkv

    if not hasattr(PagedCache, "from_prefix") or "prefix_caching" not in inspect.signature(BlockPool).parameters:
        return None
    shared = ids[:prefix_len]
    first = torch.cat([shared, ids[prefix_len: prefix_len + suffix_len]])[None]
    second = torch.cat([shared, ids[prefix_len + suffix_len: prefix_len + 2 * suffix_len]])[None]
    gen = getattr(hf_pagedkv, "generate", None)
    miss, hit = [], []
    for _ in range(repeats):
        pool = BlockPool(prefix_caching=True)
        with torch.inference_mode():
            if gen is not None:
                t0 = _now()
                gen(model, first, pool=pool, max_new_tokens=1, do_sample=False)
                miss.append(_now() - t0)
                t0 = _now()
                gen(model, second, pool=pool, max_new_tokens=1, do_sample=False)
                hit.append(_now() - t0)
            else:
                cache = PagedCache(pool=pool)
                t0 = _now()
                model(first, **cache_kwargs(cache), logits_to_keep=1)
                miss.append(_now() - t0)
                cache.publish(first)
                cache.release()
                t0 = _now()
                cache = PagedCache.from_prefix(pool, second)
                model(second[:, cache.get_seq_length():], **cache_kwargs(cache), logits_to_keep=1)
                hit.append(_now() - t0)
                cache.release()
    return {"miss_s": statistics.median(miss), "hit_s": statistics.median(hit)}


def hook_overhead(model, prompt: torch.Tensor, step_ms: float, calls: int = 20000) -> dict:
    """Cost of the metrics/event hooks a decode step runs, against the decode step time measured above."""
    pool = BlockPool(block_size=16)
    cache = PagedCache(pool=pool, config=model.config)
    with torch.inference_mode():
        model(prompt, **cache_kwargs(cache), logits_to_keep=1)
    m, ev = pool.metrics, pool.events
    t0 = _now()
    for _ in range(calls):
        m.on_step(cache, 1, 0)
        ev.on_step(cache.seq_id, None, [])
        ev.emit("free", [])
    hook_us = 1e6 * (_now() - t0) / calls
    t0 = _now()
    for _ in range(20):
        m.check_alerts()
    check_us = 1e6 * (_now() - t0) / 20
    cache.release()
    # alerts are checked at most once per `check_interval` (1 s): that cost is spread over a second of steps
    per_step_us = hook_us + check_us * (step_ms / 1000) / m.thresholds.check_interval
    return {"hook_us": hook_us, "check_us": check_us, "overhead": per_step_us / (1000 * step_ms)}


# -- report -----------------------------------------------------------------------------------------------------------
def plot(out: Path, lengths: list[int], sweep: dict, configs: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for key, ylabel, name in (("tok_s", "decode tokens/s", "decode_throughput.png"),
                              ("bytes", "KV MiB at the end", "kv_bytes.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind in configs:
            ys = [sweep[(n, kind)][key] / (MiB if key == "bytes" else 1) for n in lengths]
            ax.plot(lengths, ys, marker="o", label=kind)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"SmolLM2-135M, {ylabel}")
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(name)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 512 and 2048 only, 8 new tokens, 1 repeat")
    p.add_argument("--lengths", help="context lengths of the decode sweep (default: 512,1024,2048,4096)")
    p.add_argument("--decode-tokens", type=int, help="timed decode steps per run (default: 32)")
    p.add_argument("--new-tokens", type=int, help="new tokens for beam search and sampling (default: 32)")
    p.add_argument("--gen-prompt", type=int, default=1024, help="prompt tokens for beam search and sampling")
    p.add_argument("--repeats", type=int, help="interleaved repeats, median taken (default: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for RESULTS.md and plots (default: benchmarks/, quick: benchmarks/quick/)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or this process's CPU time (steadier when other jobs share the machine)")
    args = p.parse_args(argv)
    global _now
    _now = time.process_time if args.clock == "cpu" else time.perf_counter
    defaults = ("512,2048", 8, 8, 1) if args.quick else ("512,1024,2048,4096", 32, 32, 3)
    for name, value in zip(("lengths", "decode_tokens", "new_tokens", "repeats"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    lengths = [int(n) for n in args.lengths.split(",")]
    out = Path(args.out or (ROOT / "benchmarks" / ("quick" if args.quick else "")))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    machine = describe_machine()
    machine["clock"] = "process CPU time" if args.clock == "cpu" else "wall time"
    for k, v in machine.items():
        print(f"{k}: {v}", flush=True)
    model, tokenizer = load_model()
    ids = corpus_ids(tokenizer)
    presets = quant_presets()
    if args.quick:
        presets = presets[:1]
    configs = ["dynamic", "paged", *presets]
    print(f"configs: {', '.join(configs)}{'' if presets else ' (no quantized presets in this checkout)'}", flush=True)
    shape = ModelShape.from_config(model.config, "SmolLM2-135M-Instruct")
    lines: list[str] = []  # summary lines, printed and written to RESULTS.md

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    # warm-up: every configuration once on a short prompt
    for kind in configs:
        decode_run(model, ids[None, :64], kind, 4)

    # 1. decode throughput and KV bytes against context length
    sweep: dict[tuple[int, str], dict] = {}
    table = ["| context | config | decode tok/s | vs Dynamic | step ms | cache P99 ms | KV MiB | vs Dynamic "
             "| planner MiB |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in lengths:
        prompt = ids[None, :n]
        runs = interleaved(configs, args.repeats,
                           lambda kind, prompt=prompt: decode_run(model, prompt, kind, args.decode_tokens))
        for kind in configs:
            sweep[(n, kind)] = {**runs[kind][0], "tok_s": median_of(runs[kind], "tok_s"),
                                "step_ms": median_of(runs[kind], "step_ms")}
        base = sweep[(n, "dynamic")]
        for kind in configs:
            r = sweep[(n, kind)]
            plan, p99 = "", ""
            if kind != "dynamic":
                quant = "fp" if kind == "paged" else kind
                planned = plan_capacity(shape, n + args.decode_tokens, 1, quant=quant, dtype="float32").kv_bytes
                plan = f"{planned / MiB:.1f}"
                p99 = f"{r['p99_ms']:.1f}"
            table.append(f"| {n} | {kind} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
                         f"{r['step_ms']:.1f} | {p99} | {r['bytes'] / MiB:.1f} | {r['bytes'] / base['bytes']:.2f}x "
                         f"| {plan} |")
        same = torch.equal(sweep[(n, "paged")]["tokens"], base["tokens"])
        say(f"context {n}: PagedCache fp decode {sweep[(n, 'paged')]['tok_s'] / base['tok_s']:.2f}x DynamicCache "
            f"tokens/s, KV bytes {sweep[(n, 'paged')]['bytes'] / base['bytes']:.2f}x, greedy tokens "
            f"{'identical' if same else 'DIFFERENT'}")
    for n in (512, 2048):
        if (n, "paged") in sweep:
            ratio = sweep[(n, "paged")]["tok_s"] / sweep[(n, "dynamic")]["tok_s"]
            say(f"decode tokens/s at prompt {n}, PagedCache vs DynamicCache: {ratio:.2f}x (target >= 0.95x)")

    # 2. beam search and parallel sampling, prompt 1024
    prompt = ids[None, : args.gen_prompt]
    for label, gen, targets in (
        ("beam search num_beams=4", {"num_beams": 4, "do_sample": False}, (1.0, 0.5)),
        ("4 samples (num_return_sequences=4)", {"num_return_sequences": 4, "do_sample": True, "top_k": 50},
         (None, 0.35)),
    ):
        gen_configs = ["dynamic", "paged"]
        generate_run(model, ids[None, :64], "paged", 2, args.seed, **gen)  # warm-up of this mode
        generate_run(model, ids[None, :64], "dynamic", 2, args.seed, **gen)
        runs = interleaved(gen_configs, args.repeats,
                           lambda kind, gen=gen: generate_run(model, prompt, kind, args.new_tokens, args.seed, **gen))
        d, q = runs["dynamic"], runs["paged"]
        t_ratio = median_of(q, "seconds") / median_of(d, "seconds")
        b_ratio = q[0]["bytes"] / d[0]["bytes"]
        peak = q[0]["peak_bytes"] / d[0]["bytes"]
        same = torch.equal(q[0]["sequences"], d[0]["sequences"])
        time_target = f" (target <= {targets[0]:.1f}x)" if targets[0] else ""
        say(f"{label}, {args.gen_prompt}-token prompt, {args.new_tokens} new tokens: "
            f"time {t_ratio:.2f}x{time_target}, "
            f"KV bytes {b_ratio:.2f}x (target <= {targets[1]}x; pool peak {peak:.2f}x) of DynamicCache "
            f"({d[0]['bytes'] / MiB:.1f} MiB), outputs {'identical' if same else 'DIFFERENT'}")

    # 3. prefix-hit time to first token
    ttft = prefix_ttft(model, ids, 2048, 32, args.repeats)
    if ttft is None:
        say("prefix-hit time to first token: skipped (no prefix caching in this checkout)")
    else:
        say(f"prefix-hit time to first token, 2048-token shared prefix + 32-token suffix: "
            f"{ttft['hit_s'] / ttft['miss_s']:.2f}x ({ttft['hit_s']:.2f} s vs {ttft['miss_s']:.2f} s; "
            "target <= 0.15x)")

    # 4. metrics overhead
    step_ms = sweep[(lengths[0], "paged")]["step_ms"]
    oh = hook_overhead(model, ids[None, : lengths[0]], step_ms)
    say(f"metrics overhead: hooks {oh['hook_us']:.2f} us per decode step + alert check {oh['check_us']:.0f} us per "
        f"second = {oh['overhead']:.4%} of a {step_ms:.1f} ms decode step at context {lengths[0]} (target < 2%)")

    plots = plot(out, lengths, sweep, configs)
    title = "Benchmark results" + (" (QUICK smoke run: 1 repeat, few tokens; do not quote)" if args.quick else "")
    command = " ".join(["python benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])])
    md = [f"# {title}", "", f"Written by `{command}`.", "",
          "## Machine", "", *[f"- {k}: {v}" for k, v in machine.items()], "",
          f"Settings: decode {args.decode_tokens} timed steps after an untimed prefill, beam/sampling "
          f"{args.new_tokens} new tokens, {args.repeats} interleaved repeats (median), seed {args.seed}, "
          "block_size 16, fp32 model and cache.", "",
          "## Summary", "", *[f"- {line}" for line in lines], "",
          "## Decode throughput and KV bytes against context length", "", *table, "",
          *[f"![{name}]({name})" for name in plots], ""]
    (out / "RESULTS.md").write_text("\n".join(md), encoding="utf-8")
    print(f"wrote {out / 'RESULTS.md'} and {', '.join(plots)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
