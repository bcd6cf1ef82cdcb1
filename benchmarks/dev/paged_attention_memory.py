"""Peak memory of a decode step with the ``"hf_pagedkv"`` attention: how far the process's resident memory rises
above what it held before the step (Linux: VmHWM reset through /proc/self/clear_refs, then read back), SmolLM2.

    python benchmarks/dev/paged_attention_memory.py                          # 2048 tokens, batch 1 and 8
    python benchmarks/dev/paged_attention_memory.py --lengths 4096 --batches 1

The issue's bound is "the pool plus one tile per layer": the pool is allocated before the step, so the step's rise
should stay within one layer's working set of the attention (a tile of codes in the compute dtype, the scores) plus
the model's own activations (the logits: `batch * vocab` floats), which `DynamicCache` needs as well. Reported per
case: the largest rise over `--steps` steps, the pool's reserved bytes, and the bound "one tile" =
`2 * batch * kv_heads * min(tile_tokens, seq_len) * head_dim * 4` bytes (keys and values, fp32: what the step's first
layer, which reads a normal copy to probe the attention, holds), with the logits bytes beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.attention import DEFAULT_TILE_TOKENS
from hf_pagedkv.tools.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paged_attention import make_cache, prefill, prompt_kv  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_rise(model, cache, tok: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes the process's peak resident memory rises above its resident memory before one decode step."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    with torch.no_grad():
        tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    return (_status_kib("VmHWM") - before) * 1024, tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048", help="prompt lengths, comma-separated")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--methods", default="dynamic,fp/paged,k8v8/paged,k8v4/paged,k4v4/paged,k4v4/sdpa")
    ap.add_argument("--steps", type=int, default=6, help="decode steps per case (the largest rise is reported)")
    args = ap.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # re-run with large allocations mapped one by one
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if not Path("/proc/self/clear_refs").exists():
        print("needs Linux (/proc/self/clear_refs)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    model, _ = load_model()
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    full = prefill(model, torch.randint(100, cfg.vocab_size, (1, max(lengths)), generator=g))
    print(f"peak resident memory a decode step adds (MiB), SmolLM2-135M fp32, tile {DEFAULT_TILE_TOKENS} tokens")
    print("| tokens | batch | cache | attention | step rise | pool reserved | one tile | logits |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for n in lengths:
        for batch in map(int, args.batches.split(",")):
            kv = prompt_kv(full, n, batch, 0)
            tile = 2 * batch * kv_heads * min(DEFAULT_TILE_TOKENS, n) * head_dim * 4  # keys and values, fp32
            logits = batch * cfg.vocab_size * 4
            for m in args.methods.split(","):
                model.set_attn_implementation("hf_pagedkv" if m.endswith("/paged") else "sdpa")
                cache = make_cache(m, model)
                with torch.no_grad():
                    for i, (k, v) in enumerate(kv):
                        cache.update(k.clone(), v.clone(), i)
                tok = torch.randint(100, cfg.vocab_size, (batch, 1), generator=g)
                _, tok = step_rise(model, cache, tok)  # warm-up
                rise = 0
                for _ in range(args.steps):
                    r, tok = step_rise(model, cache, tok)
                    rise = max(rise, r)
                pool = cache.pool.stats().bytes_reserved if isinstance(cache, PagedCache) else \
                    sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
                cache_name, attn = (m.split("/") + ["sdpa"])[:2]
                print(f"| {n} | {batch} | {cache_name} | {attn} | {rise / 2**20:.1f} | {pool / 2**20:.1f} | "
                      f"{tile / 2**20:.1f} | {logits / 2**20:.1f} |", flush=True)
                if isinstance(cache, PagedCache):
                    cache.release()
                del cache
                model.set_attn_implementation("sdpa")
    return 0


if __name__ == "__main__":
    sys.exit(main())
