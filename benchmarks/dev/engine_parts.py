"""Where the serving engine's CPU goes on `benchmarks/serving.py`'s `mixed` workload, per part, without a profiler:
SmolLM2, one thread, CPU time (`time.process_time`).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/engine_parts.py --rounds 3

Runs the engine on the `mixed` prompts (16 requests x 16 new tokens, `--max-batch-tokens` 512 unless given, blocks
of 16, a growable full-precision pool), after one untimed warm-up run, `--rounds` times, and prints each round's CPU
seconds: the whole run, and the parts timed by wrapping a few functions (`PartTimer`, about a microsecond per call):
the packed step's cache work (`PackedCache.update`: each layer's writes and each request's history; inside it the
one write per layer for every request, `PackedWrites.update`, and the requests that go through their own
`PagedCache.update`), the page store's `write`, `read_view` (a history read as a view) and `read_blocks` (gathered),
the packed attention function (inside it `torch.nn.functional.scaled_dot_product_attention`), and the compaction
between steps (`BlockPool.compact`). Parts nest (a part's time includes the parts called inside it).

`--ops N` adds one run under `torch.profiler` and prints its N costliest operators by self CPU time, and the share of
the model's matrix products (`aten::mm`, `aten::addmm`, `aten::bmm`): the work any engine of the same tokens does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for serving.py

from benchmarks.part_timer import PartTimer  # noqa: E402
from hf_pagedkv import BlockPool  # noqa: E402
from hf_pagedkv.serving import packed_attention  # noqa: E402
from hf_pagedkv.serving.packed_cache import PackedCache, PackedWrites  # noqa: E402
from hf_pagedkv.storage.page_store import PageStore  # noqa: E402
from serving import load_model, prompts_for, run_engine  # noqa: E402

TIMER = PartTimer(clock=time.process_time)
PARTS = []  # the parts, in the order `instrument` wraps them (what prints)


def patch(owner, name: str, part: str) -> None:
    TIMER.patch(owner, name, part)
    PARTS.append(part)


def instrument() -> None:
    """Wrap the timed parts (attributes their callers look up at call time)."""
    patch(PackedCache, "update", "PackedCache.update")
    patch(PackedWrites, "update", "  PackedWrites.update (one write per layer)")
    patch(PackedCache, "_update_one", "  a request's own PagedCache.update")
    patch(PageStore, "write", "    store.write")
    patch(PageStore, "read_view", "    store.read_view")
    patch(PageStore, "read_blocks", "    store.read_blocks (gathered)")
    name = packed_attention.PACKED_ATTENTION_NAME  # the packed attention, as the model looks it up
    ALL_ATTENTION_FUNCTIONS[name] = TIMER.timed(ALL_ATTENTION_FUNCTIONS[name], "packed attention")
    PARTS.append("packed attention")
    patch(F, "scaled_dot_product_attention", "  F.scaled_dot_product_attention")
    patch(BlockPool, "compact", "BlockPool.compact")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--ops", type=int, default=0, help="also profile one run and print its N costliest operators")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model(None, device="cpu")
    prompts = prompts_for("mixed", args.requests, model.get_input_embeddings().num_embeddings)
    instrument()
    run_engine(model, prompts, args.new, BlockPool(16), args.max_batch_tokens)  # warm-up
    print(f"mixed: {args.requests} requests x {args.new} new tokens, CPU seconds per engine run (one thread)")
    for r in range(args.rounds):
        TIMER.clear()
        t0 = time.process_time()
        run_engine(model, prompts, args.new, BlockPool(16), args.max_batch_tokens)
        total = time.process_time() - t0
        parts = "; ".join(f"{k.strip()} {TIMER.seconds[k]:.3f}" for k in PARTS if k in TIMER.seconds)
        print(f"  round {r + 1}: engine {total:.2f}; {parts}", flush=True)
    if args.ops:
        print_ops(model, prompts, args)


def print_ops(model, prompts, args) -> None:
    """One engine run under `torch.profiler`: its costliest operators, and the matrix products' share."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_engine(model, prompts, args.new, BlockPool(16), args.max_batch_tokens)
    total = time.process_time() - t0
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    products = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    print(f"profiled run: {total:.2f} s CPU (profiler included); matrix products {products:.2f} s")
    for e in ops[:args.ops]:
        print(f"  {e.key:<52} {e.self_cpu_time_total / 1e6:7.3f} s  {e.count:7d} calls")


if __name__ == "__main__":
    main()
