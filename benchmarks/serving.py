"""Continuous batching side by side: hf_pagedkv's engine, transformers' `generate_batch`, one request at a time.

    python benchmarks/serving.py                          # 16 requests, the three workloads, one CPU thread
    python benchmarks/serving.py --requests 4 --new 4     # a smoke run
    python benchmarks/serving.py --workloads shared       # one workload

Every method runs the bundled SmolLM2-135M-Instruct (fp32, 30 layers, 3 KV heads x 64: 45 KiB of K/V per token) in
one process on one thread (`torch.set_num_threads(1)`), greedy, `--new` new tokens per request:

- `hf_pagedkv`: `hf_pagedkv.generate_batch` (the serving `Engine`, `--max-batch-tokens` per step);
- `transformers`: `model.generate_batch` (transformers' continuous batching, sdpa on the CPU), with
  `ContinuousBatchingConfig(page_size=16, max_batch_tokens=--max-batch-tokens, num_blocks=...)`: enough blocks for
  every request at once, or the blocks of the memory budget; block sharing on for the shared-prefix workload only;
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
"""

from __future__ import annotations

import argparse
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

PAGE = 16  # tokens per block, both paged caches
DEVICE = "cpu"  # --device; on CUDA the times are wall times after a synchronize


def clock() -> float:
    """Seconds: this process's CPU time on the CPU; wall time after `torch.cuda.synchronize()` on CUDA."""
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


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


def run_transformers(model, prompts, new, num_blocks, max_batch_tokens, sharing):
    from transformers import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  allow_block_sharing=sharing, use_cuda_graph=False, use_async_batching=False)
    res = model.generate_batch(prompts, config, continuous_batching_config=cb, progress_bar=False)
    outs = [res[k].generated_tokens if k in res else None for k in [f"req_{i}" for i in range(len(prompts))]]
    finished = sum(r.error is None and r.is_finished() for r in res.values())
    return outs, num_blocks * PAGE * kv_bytes_per_token(model), finished


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new", type=int, default=16, help="new tokens per request")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--workloads", nargs="+", default=["mixed", "shared", "pressure"],
                        choices=["mixed", "shared", "pressure"])
    parser.add_argument("--methods", nargs="+", default=["solo", "hf_pagedkv", "transformers"],
                        choices=["solo", "hf_pagedkv", "transformers"])
    parser.add_argument("--memory", default="64MiB", help="the pressure workload's KV budget")
    parser.add_argument("--model", default=None, help="a model id or directory (default: the bundled SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (times are then wall times after a synchronize)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
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
            if method == "transformers" and not has_cb:
                print(f"| {workload} | transformers | model.generate_batch not in this transformers | | | | | | |")
                continue
            counter.count = 0
            t0 = clock()
            if method == "solo":
                outs, peak, finished = run_solo(model, prompts, args.new)
            elif method == "hf_pagedkv":
                pool = BlockPool(PAGE, max_memory=budget, prefix_caching=workload == "shared")
                outs, peak, finished, stats = run_engine(model, prompts, args.new, pool, args.max_batch_tokens)
                notes.append(f"{workload}: hf_pagedkv {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
                             f"prefix hit rate {stats.prefix_hit_rate:.2f}, pool {pool.num_blocks} blocks")
            else:
                blocks = need + len(prompts) if budget is None else budget // (PAGE * per_token)
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
