"""Host tier benchmark: 16 requests over 4 shared prefixes on a device budget that holds 2 of them.

Three pools serve the same 16 greedy requests (prefix ``i % 4`` plus a distinct suffix, round robin, so the
prefix a request needs is always the least recently used one), in one run:

- ``device 2``: a fixed device tier that holds 2 prefixes (the running request's and one more), no host tier:
  every prefix is evicted before it comes back, so each request recomputes its whole prompt;
- ``device 2 + host``: the same device tier plus a host tier (`BlockPool(host_memory=...)`) of 4 prefixes: the
  device evicts prefixes into host memory and a hit copies them back;
- ``device 4``: a device tier large enough for all 4 prefixes, no host tier (what the hits cost without one).

Printed side by side: prefix hits, prompt tokens recomputed, device-tier bytes (the pool's preallocated storage),
host bytes, blocks and bytes copied between the tiers, wall time, and whether the greedy tokens equal the
``device 4`` run's. Each request runs on the three pools in turn (the order rotating), so the load of a shared
machine falls on all three alike. The model is the real SmolLM2-135M-Instruct (fp32, CPU by default); the prefixes
are WikiText-2 test text, the suffixes Tiny Shakespeare lines (see `prefix_cache.py`).

Without a GPU the host tier is ordinary CPU memory, so the copies are memory-to-memory and host-to-device bandwidth
is not measured (the script says so); with CUDA it also times a pinned host-to-device copy.

    python benchmarks/host_tier.py --threads 2       # 48 requests of 532 tokens: 25 minutes on 2 shared CPU cores
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import hf_pagedkv
from hf_pagedkv import BlockPool
from hf_pagedkv.tools.models import load_model
from prefix_cache import DATA, corpus_tokens, prompt

MiB = 2**20


def requests(tokenizer, args) -> list[torch.Tensor]:
    """`args.requests` prompts: prefix ``i % args.prefixes`` (distinct stretches of the document) + suffix `i`."""
    doc, suffixes, _ = corpus_tokens(tokenizer, args.data)
    n = args.prefix_tokens
    prefixes = [doc[k * n: (k + 1) * n] for k in range(args.prefixes)]
    return [prompt(prefixes[i % args.prefixes], suffixes[i], args.suffix_tokens) for i in range(args.requests)]


@torch.inference_mode()
def serve(model, prompts: list[torch.Tensor], pools: dict[str, BlockPool], args) -> dict[str, dict]:
    """Run every request through `hf_pagedkv.generate` on each pool, interleaved (request `i` on every pool, in an
    order that rotates with `i`), so a shared machine's load falls on every pool alike; one table row per pool."""
    gen = {"max_new_tokens": args.new_tokens, "do_sample": False}
    names = list(pools)
    seconds, outs = dict.fromkeys(names, 0.0), {name: [] for name in names}
    for i, x in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            outs[name].append(hf_pagedkv.generate(model, x, pool=pools[name], **gen))
            seconds[name] += time.perf_counter() - start
    rows = {}
    for name, pool in pools.items():
        pool.check_invariants()
        st = pool.stats()
        rows[name] = {"hit_tokens": st.hit_tokens, "recomputed": st.lookup_tokens - st.hit_tokens,
                      "device_bytes": st.bytes_reserved, "host_bytes": st.host_bytes_reserved,
                      "to_host": (st.blocks_to_host, st.bytes_to_host),
                      "from_host": (st.blocks_from_host, st.bytes_from_host),
                      "seconds": seconds[name], "outs": outs[name], "lookup_tokens": st.lookup_tokens}
    return rows


def bandwidth_line() -> str:
    """Host-to-device copy bandwidth of a pinned 256 MiB tensor on CUDA, or why it is not measured."""
    if not torch.cuda.is_available():
        return ("host-to-device bandwidth: not measured (no GPU here: the host tier and the device tier are both "
                "CPU memory, so the copies above are memory-to-memory)")
    src = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    gbps = 10 * src.numel() / (begin.elapsed_time(end) / 1e3) / 1e9
    return f"host-to-device bandwidth ({torch.cuda.get_device_name()}, pinned, 256 MiB x 10): {gbps:.1f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the bundled SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--device-prefixes", type=int, default=2, help="prefixes the small device tier holds")
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device)
    prompts = requests(tokenizer, args)
    bs = args.block_size
    prefix_blocks = args.prefix_tokens // bs
    # a request holds its prefix's blocks plus `own` more (suffix and new tokens; generate publishes the full ones
    # too, so they stay cached-idle after it); a tier "fits k prefixes" when it holds k such requests
    own = -(-(args.prefix_tokens + args.suffix_tokens + args.new_tokens) // bs) - prefix_blocks
    small = args.device_prefixes * (prefix_blocks + own)
    large = args.prefixes * (prefix_blocks + own)
    # warm-up (kernels and the model fingerprint, computed once per model: not timed in any row) and the bytes of
    # one block, all layers
    sizer = BlockPool(block_size=bs, prefix_caching=True)
    hf_pagedkv.generate(model, prompts[0][:, :32], pool=sizer, max_new_tokens=1, do_sample=False)
    block_bytes = sizer.stats().bytes_per_block
    host_memory = args.prefixes * (prefix_blocks + own) * block_bytes  # room for every prefix
    pools = {"device 2": BlockPool(block_size=bs, num_blocks=small, prefix_caching=True),
             "device 2 + host": BlockPool(block_size=bs, num_blocks=small, prefix_caching=True,
                                          host_memory=host_memory),
             "device 4": BlockPool(block_size=bs, num_blocks=large, prefix_caching=True)}
    rows = serve(model, prompts, pools, args)
    ref = rows["device 4"]["outs"]
    print(f"# {args.requests} requests over {args.prefixes} prefixes of {args.prefix_tokens} tokens "
          f"(+{args.suffix_tokens}-token suffix, {args.new_tokens} new tokens, greedy), block_size {bs}: "
          f"device tiers of {small} blocks ({args.device_prefixes} x (prefix {prefix_blocks} + a request's own "
          f"{own})) and {large} blocks ({args.prefixes} x); requests interleaved over the pools; "
          f"{platform.machine()} {args.device}, {args.threads} threads, torch {torch.__version__}")
    print("| pool | prefix hit tokens | prompt tokens recomputed | device-tier bytes | host-tier bytes | "
          "to host (blocks, MiB) | from host (blocks, MiB) | time (s) | tokens = device 4 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, r in rows.items():
        same = all(torch.equal(a, b) for a, b in zip(r["outs"], ref))
        print(f"| {name} | {r['hit_tokens']:,} of {r['lookup_tokens']:,} | {r['recomputed']:,} | "
              f"{r['device_bytes'] / MiB:.1f} MiB | {r['host_bytes'] / MiB:.1f} MiB | "
              f"{r['to_host'][0]:,}, {r['to_host'][1] / MiB:.1f} | "
              f"{r['from_host'][0]:,}, {r['from_host'][1] / MiB:.1f} | {r['seconds']:.1f} | "
              f"{'yes' if same else 'NO'} |")
    a, b, c = rows["device 2"], rows["device 2 + host"], rows["device 4"]
    print(f"device 2 + host vs device 2: recomputed tokens {b['recomputed'] / max(a['recomputed'], 1):.3f}x, "
          f"time {b['seconds'] / a['seconds']:.3f}x, device bytes {b['device_bytes'] / a['device_bytes']:.3f}x")
    print(f"device 2 + host vs device 4: device bytes {b['device_bytes'] / c['device_bytes']:.3f}x for "
          f"{b['hit_tokens'] / max(c['hit_tokens'], 1):.3f}x the hit tokens, time {b['seconds'] / c['seconds']:.3f}x")
    print(bandwidth_line())


if __name__ == "__main__":
    main()
