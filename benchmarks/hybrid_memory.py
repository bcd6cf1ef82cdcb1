"""KV bytes held on a hybrid sliding-window model: PagedCache (layer groups) against DynamicCache(config), one run.

    python benchmarks/hybrid_memory.py              # ~2-4 min on 2 CPU cores
    python benchmarks/hybrid_memory.py --quick      # one short row, a smoke run
    python benchmarks/hybrid_memory.py --retention  # plus what retention policies hold on the hybrid model

The hybrid model is Gemma3-shaped where the KV cache is concerned -- 18 layers, 15 of them sliding-window
(window 512, pattern 6) and 3 full attention, 1 KV head of head_dim 256, fp32 -- with a small hidden size and
random (seeded) weights, so it runs on a CPU; KV bytes depend only on the layer plan, heads, head_dim, dtype and
token counts. It also runs the bundled SmolLM2-135M-Instruct (all full attention) as the control row. Bytes are what
each cache holds at the end of `generate` (`pool.stats().bytes_in_use` and the tensors of `DynamicCache`); tokens
must be identical (greedy and beams) or the script exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_pagedkv import PagedCache, cache_kwargs  # noqa: E402
from hf_pagedkv.retention import KeyDiff, SinkWindow  # noqa: E402
from hf_pagedkv.tools.verify import dynamic_cache_bytes  # noqa: E402

MB = 1e6


def hybrid_model() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              sliding_window_pattern=6, max_position_embeddings=8192, pad_token_id=0,
                              bos_token_id=2, eos_token_id=1)
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def run(model, prompt_len: int, new: int, block_size: int, **kw) -> tuple[int, int, bool]:
    """(PagedCache bytes, DynamicCache bytes, same tokens) after one generate of each."""
    g = torch.Generator().manual_seed(prompt_len)
    x = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
    outs, held = [], []
    for make in (lambda: PagedCache(block_size=block_size, config=model.config), lambda: DynamicCache(
            config=model.config)):
        cache = make()
        torch.manual_seed(1)
        outs.append(model.generate(x, **cache_kwargs(cache), max_new_tokens=new, min_new_tokens=new, **kw))
        held.append(cache.pool.stats().bytes_in_use if isinstance(cache, PagedCache) else dynamic_cache_bytes(cache))
        if isinstance(cache, PagedCache):
            cache.pool.check_invariants()
            cache.release()
    same = outs[0].shape == outs[1].shape and bool(torch.equal(outs[0], outs[1]))
    return held[0], held[1], same


def run_retention(model, prompt_len: int, new: int, block_size: int, retention) -> tuple[int, int, int]:
    """(bytes held by the full-attention group, by the sliding groups, tokens held per row) after one greedy
    `generate` through `PagedCache(retention=...)` (a different output than without it: tokens were evicted)."""
    g = torch.Generator().manual_seed(prompt_len)
    x = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
    cache = PagedCache(block_size=block_size, config=model.config, retention=retention)
    model.generate(x, **cache_kwargs(cache), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    groups = cache.pool.stats().groups
    full = sum(grp.bytes_in_use for grp in groups if grp.window is None)
    held = (sum(grp.bytes_in_use for grp in groups) - full, cache.retention_stats().tokens_held)
    cache.pool.check_invariants()
    cache.release()
    return (full, *held)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short hybrid row only")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--retention", action="store_true", help="also the retention rows (4096 tokens)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = hybrid_model()
    rows = [("greedy, 631 tokens", 599, 32, {}), ("greedy, 1131 tokens", 1099, 32, {}),
            ("greedy, 4096 tokens", 4064, 32, {}), ("3 beams, 1131 tokens", 1099, 32, {"num_beams": 3}),
            ("4 samples, 1131 tokens", 1099, 32, {"do_sample": True, "num_return_sequences": 4})]
    if args.quick:
        rows = rows[:1]
    print(f"hybrid Gemma3-shaped model: 18 layers (15 sliding, window 512; 3 full), 1 KV head x 256, fp32, "
          f"block_size {args.block_size}")
    print("| run | DynamicCache(config) | PagedCache | ratio | tokens |")
    print("| --- | ---: | ---: | ---: | --- |")
    ok = True
    for name, n, new, kw in rows:
        paged, dyn, same = run(model, n, new, args.block_size, **kw)
        ok &= same or kw.get("do_sample", False)  # sampling: same seed, same tokens expected too, but not required
        print(f"| {name} | {dyn / MB:.1f} MB | {paged / MB:.1f} MB | {paged / dyn:.2f}x | "
              f"{'identical' if same else 'DIFFERENT'} |")
    if args.retention:
        print()
        print("retention on the hybrid model, greedy, 4064 + 32 tokens: KV bytes held by layer group")
        print("| retention | full-attention layers | sliding-window layers | total | tokens held (full layers) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for policy in (None, SinkWindow(sink_tokens=4, window=1024), KeyDiff(budget=1024),
                       KeyDiff(compression_ratio=0.5)):
            full, sliding, held = run_retention(model, 4064, 32, args.block_size, policy)
            print(f"| {policy or 'none'} | {full / MB:.1f} MB | {sliding / MB:.1f} MB | {(full + sliding) / MB:.1f} MB "
                  f"| {held} |")
    if not args.quick:
        from hf_pagedkv.tools.models import load_model

        smol, _ = load_model()
        paged, dyn, same = run(smol, 1099, 32, args.block_size)
        ok &= same
        print(f"| SmolLM2-135M (all full attention), greedy, 1131 tokens | {dyn / MB:.1f} MB | {paged / MB:.1f} MB | "
              f"{paged / dyn:.2f}x | {'identical' if same else 'DIFFERENT'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
