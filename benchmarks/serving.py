"""Continuous batching side by side: hf_pagedkv's engine, transformers' `generate_batch`, one request at a time.

    python benchmarks/serving.py                          # 16 requests, the three workloads, one CPU thread
    python benchmarks/serving.py --requests 4 --new 4     # a smoke run
    python benchmarks/serving.py --workloads shared       # one workload
    python benchmarks/serving.py --arrivals poisson --rate 1 --methods hf_pagedkv transformers   # latency

Every method runs the bundled SmolLM2-135M-Instruct (fp32, 30 layers, 3 KV heads x 64: 45 KiB of K/V per token) in
one process on one thread (`torch.set_num_threads(1)`), greedy, `--new` new tokens per request:

- `hf_pagedkv`: `hf_pagedkv.generate_batch` (the serving `Engine`, `--max-batch-tokens` per step);
- `hf_pagedkv-k8v4`: the same engine on `BlockPool(quant="k8v4")` (8-bit keys, 4-bit values, its default blocks
  of 32 tokens) with the same budget, its decode segments reading their codes in place; its tokens may differ
  from `solo`'s within the codec's drift;
  `hf_pagedkv-k4v4` (not run by default): the same with 4-bit keys;
- `hf_pagedkv-inplace`, `hf_pagedkv-k8v4-inplace`, `hf_pagedkv-k4v4-inplace` (not run by default): those engines
  with the model's attention set to ``"hf_pagedkv"`` (`model.set_attn_implementation`, restored after): decode
  segments of a full-precision pool then read their blocks in place too (a quantized pool's always do);
- `transformers`: `model.generate_batch` (transformers' continuous batching, sdpa on the CPU), with
  `ContinuousBatchingConfig(page_size=16, max_batch_tokens=--max-batch-tokens, num_blocks=...)`: enough blocks for
  every request at once, or the blocks of the memory budget (`--transformers-pages all` gives it every request
  at once under a budget too: the budget then binds the engine only); block sharing on for the shared-prefix
  workload only;
- `transformers-default` (not run by default): `model.generate_batch(prompts, generation_config)` with transformers'
  default `ContinuousBatchingConfig` (a cache of 60% of the free memory on a CPU, pages of 256 tokens; it takes no
  budget); its peak KV is the cache tensor it allocates;
- `solo`: `model.generate` on each prompt alone with a `DynamicCache` (the reference tokens).

Workloads (prompts are seeded random token ids):

- `mixed`: `--requests` prompts of 16-256 tokens; a growable pool;
- `shared`: a 256-token system prompt + a 16-64-token question each; `BlockPool(prefix_caching=True)`;
- `pressure`: the `mixed` prompts in `BlockPool(max_memory="64MiB")` (the pool is sized from the model's first
  layer: 64 MiB // (45 KiB per token) = 91 blocks of 16 tokens, 1,456 tokens for 16 requests that need ~2,400).

Columns: CPU seconds (`time.process_time`, the whole call) and per generated token, its ratio to `solo` (below 1:
less CPU per token), tokens through the model (counted at the embedding layer: prefill chunks, decode tokens,
recomputation after preemption), peak KV bytes (`hf_pagedkv`: the pool's bytes in use after a step, at most;
`solo`: the largest `DynamicCache`; `transformers`: its preallocated paged cache), requests finished, and requests
whose tokens are identical to `solo`'s. Each method runs once after a warm-up of one short request.

`--arrivals poisson --rate R` (requests per second; `--seed` seeds the schedule): instead of all at once, the
requests arrive over time with exponential gaps of mean 1/R seconds, and each method prints P50/P99 end-to-end
latency (arrival to last token) and time to first token (arrival to first token), in wall-clock seconds, plus its
CPU time and requests finished. The engine is stepped in this thread and takes each request between steps once its
time has come; transformers runs its `ContinuousBatchingManager` (`model.init_continuous_batching`) in its own
background thread and gets `add_request` at each arrival; `solo` is not run in this mode.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hf_pagedkv  # noqa: E402
from hf_pagedkv import BlockPool, cache_kwargs  # noqa: E402
from hf_pagedkv.config import parse_bytes  # noqa: E402
from hf_pagedkv.tools.models import load_model  # noqa: E402
from step_clock import clock, use_device  # noqa: E402  (beside this script)

PAGE = 16  # tokens per block, both paged caches


def prompts_for(workload: str, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda length: torch.randint(100, vocab, (length,), generator=g).tolist()  # noqa: E731
    if workload == "shared":
        system = ids(256)
        return [system + ids(int(torch.randint(16, 65, (), generator=g))) for _ in range(n)]
    return [ids(int(torch.randint(16, 257, (), generator=g))) for _ in range(n)]


class TokenCounter:
    """Tokens through the model: a hook on the input embedding counts every id it embeds."""

    def __init__(self, model) -> None:
        self.count = 0
        model.get_input_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        self.count += args[0].numel()


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_key_value_heads * head_dim * c.num_hidden_layers * torch.finfo(model.dtype).bits // 8


def run_solo(model, prompts, new):
    outs, peak = [], 0
    for p in prompts:
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([p], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             **cache_kwargs(cache))
        outs.append(out[0, len(p):].tolist())
        peak = max(peak, sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers))
    return outs, peak, len(outs)


def run_engine(model, prompts, new, pool, max_batch_tokens):
    """What `hf_pagedkv.generate_batch` does (add every request, step until done), keeping the engine's stats."""
    engine = hf_pagedkv.Engine(model, pool, max_batch_tokens=max_batch_tokens)
    rids = [engine.add_request(p, max_new_tokens=new, eos_token_id=model.generation_config.eos_token_id)
            for p in prompts]
    while engine.has_unfinished:
        engine.step()
    outs = [engine.output(r) for r in rids]
    stats = engine.stats()
    engine.close()
    return [o.generated_tokens for o in outs], stats.kv_bytes_peak, stats.num_finished, stats


ENGINE_QUANT = {"hf_pagedkv-k8v4": "k8v4", "hf_pagedkv-k4v4": "k4v4"}  # quantized engine methods -> preset
ENGINE_METHODS = ["hf_pagedkv", *ENGINE_QUANT]
IN_PLACE = "-inplace"  # an engine method with this suffix runs with the model's attention set to "hf_pagedkv"


@contextlib.contextmanager
def method_attention(model, method: str):
    """The model's attention for `method`: ``"hf_pagedkv"`` for a ``-inplace`` method, its own otherwise."""
    own = model.config._attn_implementation
    if method.endswith(IN_PLACE):
        model.set_attn_implementation("hf_pagedkv")
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def engine_pool(method: str, budget: int | None, sharing: bool) -> BlockPool:
    """The pool of an engine method: fp blocks of `PAGE` tokens, or quantized blocks of their default size."""
    method = method.removesuffix(IN_PLACE)
    if method in ENGINE_QUANT:
        return BlockPool(max_memory=budget, prefix_caching=sharing, quant=ENGINE_QUANT[method])
    return BlockPool(PAGE, max_memory=budget, prefix_caching=sharing)


def poisson_schedule(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds after the start, increasing) of `n` requests with exponential gaps of mean 1/rate."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n, dtype=torch.float64).exponential_(rate, generator=g)
    return torch.cumsum(gaps, 0).tolist()


def run_engine_arrivals(model, prompts, new, pool, max_batch_tokens, arrivals):
    """Step the engine in this thread, adding each request between steps once its arrival time has come.

    Returns:
        `(outputs, arrival times)`: each request's `RequestOutput` and its arrival on `time.perf_counter`'s clock.
    """
    engine = hf_pagedkv.Engine(model, pool, max_batch_tokens=max_batch_tokens)
    start = time.perf_counter()
    due = [start + a for a in arrivals]
    rids, i = [], 0
    while i < len(prompts) or engine.has_unfinished:
        now = time.perf_counter()
        while i < len(prompts) and due[i] <= now:
            rids.append(engine.add_request(prompts[i], max_new_tokens=new,
                                           eos_token_id=model.generation_config.eos_token_id))
            i += 1
        if engine.has_unfinished:
            engine.step()
        elif i < len(prompts):
            time.sleep(max(0.0, due[i] - time.perf_counter()))
    outs = [engine.output(r) for r in rids]
    engine.close()
    return outs, due


def run_transformers_arrivals(model, prompts, new, num_blocks, max_batch_tokens, sharing, arrivals):
    """transformers' `ContinuousBatchingManager` in its background thread, `add_request` at each arrival time.

    Returns:
        `(outputs, arrival times)`: each request's `GenerationOutput` (None if it never came back) and arrival.
    """
    from transformers import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  allow_block_sharing=sharing, use_cuda_graph=False, use_async_batching=False)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    start = time.perf_counter()
    due = [start + a for a in arrivals]
    results = {}
    try:
        for i, p in enumerate(prompts):
            time.sleep(max(0.0, due[i] - time.perf_counter()))
            manager.add_request(p, request_id=f"req_{i}", max_new_tokens=new, record_timestamps=True)
        deadline = time.perf_counter() + 600
        while len(results) < len(prompts) and time.perf_counter() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished():
                results[out.request_id] = out
    finally:
        manager.stop(block=True)
    return [results.get(f"req_{i}") for i in range(len(prompts))], due


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100, linear interpolation) of `values`; NaN when empty."""
    if not values:
        return float("nan")
    return torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100).item()


def arrivals_main(args, model, vocab, per_token) -> int:
    """The `--arrivals poisson` mode: P50/P99 end-to-end latency and TTFT per workload and method."""
    arrivals = poisson_schedule(args.requests, args.rate, args.seed)
    print(f"# Poisson arrivals: {args.requests} requests at {args.rate}/s (seed {args.seed}), last at "
          f"{arrivals[-1]:.1f} s; latencies in wall-clock seconds")
    print("| workload | method | e2e P50 s | e2e P99 s | TTFT P50 s | TTFT P99 s | CPU s | finished |")
    print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        prompts = prompts_for(workload, args.requests, vocab)
        need = sum(-(-(len(p) + args.new) // PAGE) for p in prompts)
        budget = parse_bytes(args.memory) if workload == "pressure" else None
        for method in args.methods:
            if method == "solo":
                continue
            t0 = clock()
            if method == "transformers":
                if not hasattr(model, "init_continuous_batching"):
                    print(f"| {workload} | transformers | no ContinuousBatchingManager in this transformers "
                          "| | | | | |")
                    continue
                blocks = transformers_pages(args, need + len(prompts), budget, per_token)
                outs, due = run_transformers_arrivals(model, prompts, args.new, blocks, args.max_batch_tokens,
                                                      workload == "shared", arrivals)
            else:
                pool = engine_pool(method, budget, workload == "shared")
                with method_attention(model, method):
                    outs, due = run_engine_arrivals(model, prompts, args.new, pool, args.max_batch_tokens, arrivals)
            cpu = clock() - t0
            done = [(o, t) for o, t in zip(outs, due) if o is not None and o.error is None and o.timestamps]
            e2e = [o.timestamps[-1] - t for o, t in done]
            ttft = [o.timestamps[0] - t for o, t in done]
            print(f"| {workload} | {method} | {percentile(e2e, 50):.2f} | {percentile(e2e, 99):.2f} | "
                  f"{percentile(ttft, 50):.2f} | {percentile(ttft, 99):.2f} | {cpu:.1f} | {len(done)}/{len(prompts)} |",
                  flush=True)
    return 0


def transformers_pages(args, every_request: int, budget: int | None, per_token: int) -> int:
    """transformers' pages: `every_request` (all requests at once) without a budget or with `--transformers-pages
    all`, else as many pages of `PAGE` tokens as the budget holds."""
    if budget is None or args.transformers_pages == "all":
        return every_request
    return budget // (PAGE * per_token)


def run_transformers(model, prompts, new, num_blocks, max_batch_tokens, sharing):
    from transformers import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  allow_block_sharing=sharing, use_cuda_graph=False, use_async_batching=False)
    res = model.generate_batch(prompts, config, continuous_batching_config=cb, progress_bar=False)
    outs = [res[k].generated_tokens if k in res else None for k in [f"req_{i}" for i in range(len(prompts))]]
    finished = sum(r.error is None and r.is_finished() for r in res.values())
    return outs, num_blocks * PAGE * kv_bytes_per_token(model), finished


def run_transformers_default(model, prompts, new):
    """`model.generate_batch` with transformers' default `ContinuousBatchingConfig` (pages of 256 tokens, a cache
    sized from the free memory: 60% of it on a CPU); its peak KV is the cache tensor it allocated."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    sizes, init = [], PagedAttentionCache.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sizes.append(self.cache_tensor.nbytes)

    PagedAttentionCache.__init__ = recording_init
    try:
        res = model.generate_batch(prompts, config, progress_bar=False)
    finally:
        PagedAttentionCache.__init__ = init
    outs = [res[k].generated_tokens if k in res else None for k in [f"req_{i}" for i in range(len(prompts))]]
    finished = sum(r.error is None and r.is_finished() for r in res.values())
    return outs, max(sizes, default=0), finished


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new", type=int, default=16, help="new tokens per request")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--workloads", nargs="+", default=["mixed", "shared", "pressure"],
                        choices=["mixed", "shared", "pressure"])
    parser.add_argument("--methods", nargs="+", default=["solo", "hf_pagedkv", "hf_pagedkv-k8v4", "transformers"],
                        choices=["solo", *ENGINE_METHODS, *(m + IN_PLACE for m in ENGINE_METHODS), "transformers",
                                 "transformers-default"])
    parser.add_argument("--arrivals", default="batch", choices=["batch", "poisson"],
                        help="batch: every request at once (the table above); poisson: seeded arrivals at --rate")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (--arrivals poisson)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson schedule")
    parser.add_argument("--memory", default="64MiB", help="the pressure workload's KV budget")
    parser.add_argument("--transformers-pages", default="budget", choices=["budget", "all"],
                        help="transformers' pages under a budget: the budget's, or enough for every request at once")
    parser.add_argument("--model", default=None, help="a model id or directory (default: the bundled SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (times are then wall times after a synchronize)")
    args = parser.parse_args()
    use_device(args.device)
    torch.set_num_threads(1)
    model, _ = load_model(args.model, device=args.device)
    vocab = model.get_input_embeddings().num_embeddings
    counter = TokenCounter(model)
    has_cb = hasattr(model, "generate_batch")
    per_token = kv_bytes_per_token(model)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, one thread; "
          f"{args.requests} requests x {args.new} new tokens, max_batch_tokens={args.max_batch_tokens}, "
          f"block/page {PAGE}")
    hf_pagedkv.generate_batch(model, [[100, 101, 102]], GenerationConfig(max_new_tokens=2), progress_bar=False)
    run_solo(model, [[100, 101, 102]], 2)  # warm-up
    if any(m.endswith(IN_PLACE) or m in ENGINE_QUANT for m in args.methods):  # (loads the in-place read's C library)
        with method_attention(model, "hf_pagedkv" + IN_PLACE):
            hf_pagedkv.generate_batch(model, [[100, 101, 102]], GenerationConfig(max_new_tokens=2),
                                      pool=BlockPool(quant="k8v4"), progress_bar=False)
    if args.arrivals == "poisson":
        if args.rate <= 0:
            parser.error(f"--rate must be > 0 requests per second, got {args.rate}")
        return arrivals_main(args, model, vocab, per_token)
    print("| workload | method | CPU s | CPU ms / token | ratio to solo | tokens computed | peak KV MiB | finished "
          "| identical to solo |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    notes = []
    for workload in args.workloads:
        prompts = prompts_for(workload, args.requests, vocab)
        need = sum(-(-(len(p) + args.new) // PAGE) for p in prompts)
        budget = parse_bytes(args.memory) if workload == "pressure" else None
        ref, base = None, None
        for method in args.methods:
            if method.startswith("transformers") and not has_cb:
                print(f"| {workload} | {method} | model.generate_batch not in this transformers | | | | | | |")
                continue
            counter.count = 0
            t0 = clock()
            if method == "solo":
                outs, peak, finished = run_solo(model, prompts, args.new)
            elif method.startswith("hf_pagedkv"):
                pool = engine_pool(method, budget, workload == "shared")
                with method_attention(model, method):
                    outs, peak, finished, stats = run_engine(model, prompts, args.new, pool, args.max_batch_tokens)
                notes.append(f"{workload}: {method} {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
                             f"prefix hit rate {stats.prefix_hit_rate:.2f}, pool {pool.num_blocks} blocks of "
                             f"{pool.block_size}")
            elif method == "transformers-default":
                outs, peak, finished = run_transformers_default(model, prompts, args.new)
            else:
                blocks = transformers_pages(args, need + len(prompts), budget, per_token)
                outs, peak, finished = run_transformers(model, prompts, args.new, blocks, args.max_batch_tokens,
                                                        workload == "shared")
            cpu = clock() - t0
            generated = sum(len(o) for o in outs if o)
            if method == "solo":
                ref, base = outs, cpu / max(1, generated)
            same = "" if ref is None else sum(o == r for o, r in zip(outs, ref))
            ratio = "" if base is None else f"{cpu / max(1, generated) / base:.2f}"
            print(f"| {workload} | {method} | {cpu:.1f} | {1e3 * cpu / max(1, generated):.1f} | {ratio} | "
                  f"{counter.count} | {peak / 2 ** 20:.1f} | {finished}/{len(prompts)} | {same} |", flush=True)
            if method == "hf_pagedkv" and ref is not None and same != len(prompts):
                failed = True
    for note in notes:
        print(f"# {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
