"""Where a decode step's time goes, per part, without a profiler's distortion: SmolLM2, one process, wall time.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/step_parts.py --tokens 2048 --batch 1 --quant k4v4 \
        --attention hf_pagedkv_compiled
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/step_parts.py --tokens 64 --batch 64 --quant fp --attention sdpa

Prefills `--tokens` random tokens per row into a `DynamicCache` and into a `PagedCache` (`--quant`), runs three
untimed decode steps each, then `--steps` timed ones, `--rounds` times in turn (`DynamicCache` first, then
`PagedCache`). The parts are timed by wrapping a few functions with `time.perf_counter` (about a microsecond per
call; cProfile instead slows every Python call and skews Python-heavy paths): the caches' `update`, and inside it
`StepRunner.update_layer`, the store's `write` and `read`; the attention function, and inside it the in-place read
(`paged_attention`), its `code_read` (building the codes' views and the full-precision tail) and the compiled read's
call; and `torch.nn.functional.scaled_dot_product_attention`; the whole attention function as the model calls it
(through transformers' `ALL_ATTENTION_FUNCTIONS`); the caches' `get_mask_sizes` and `get_seq_length`. Parts nest (a
part's time includes the parts called inside it). Prints milliseconds per step, per round. A quantized read with no
encoded block yet (a prompt shorter than a block) is read as a copy, with `sdpa`: its rows then show `store.read`
and no compiled read.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from benchmarks.part_timer import PartTimer
import hf_pagedkv.attention.attention_function as attention_function
from hf_pagedkv import PagedCache, QuantConfig, cache_kwargs
from hf_pagedkv.attention.compiled_read import CompiledCodeAttention
from hf_pagedkv.adapter.step_runner import StepRunner
from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.storage.page_store import PageStore
from hf_pagedkv.storage.quantized_store import QuantizedPageStore
from hf_pagedkv.tools.models import load_model

TIMER = PartTimer()  # wall time per part


def instrument() -> None:
    """Wrap the timed parts (attributes the callers look up at call time)."""
    TIMER.patch(DynamicCache, "update", "DynamicCache.update")
    TIMER.patch(PagedCache, "update", "PagedCache.update")
    TIMER.patch(StepRunner, "update_layer", "  update_layer")
    for cls in (PageStore, QuantizedPageStore):
        TIMER.patch(cls, "write", "    store.write")
        TIMER.patch(cls, "read", "    store.read (a copy)")
    TIMER.patch(attention_function, "paged_attention", "paged_attention (in place)")
    TIMER.patch(PagedView, "code_read", "  code_read")
    TIMER.patch(CompiledCodeAttention, "__call__", "  compiled read")
    TIMER.patch(F, "scaled_dot_product_attention", "F.scaled_dot_product_attention")
    for name in ("sdpa", "hf_pagedkv", "hf_pagedkv_compiled"):  # the whole attention function, as the model calls it
        ALL_ATTENTION_FUNCTIONS[name] = TIMER.timed(ALL_ATTENTION_FUNCTIONS[name], f"attention function ({name})")
    for cls in (DynamicCache, PagedCache):
        TIMER.patch(cls, "get_mask_sizes", f"{cls.__name__}.get_mask_sizes")
        TIMER.patch(cls, "get_seq_length", f"{cls.__name__}.get_seq_length")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens per row")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quant", default="k4v4", help="fp or a QuantConfig preset (k8v8, k8v4, k4v4)")
    ap.add_argument("--attention", default="hf_pagedkv_compiled",
                    choices=["sdpa", "hf_pagedkv", "hf_pagedkv_compiled"],
                    help="the PagedCache's attention (DynamicCache always runs with sdpa)")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.batch < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--tokens, --batch, --steps and --rounds must be >= 1")
    if args.quant != "fp":
        try:
            QuantConfig.preset(args.quant)
        except ValueError as e:  # before the model loads, not after the DynamicCache round
            ap.error(f"--quant: {e}")
    torch.set_num_threads(1)
    instrument()
    model, _ = load_model()
    x = torch.randint(100, model.config.vocab_size, (args.batch, args.tokens),
                      generator=torch.Generator().manual_seed(0))
    cases = [("DynamicCache", "sdpa", DynamicCache),
             (f"PagedCache {args.quant}", args.attention,
              lambda: PagedCache(config=model.config, quant=None if args.quant == "fp" else args.quant))]
    print(f"{args.tokens} prompt token(s), batch {args.batch}: ms per decode step ({args.steps} steps per round, "
          "one thread)")
    for r in range(args.rounds):
        for name, attention, make in cases:
            model.set_attn_implementation(attention)
            cache = make()
            with torch.no_grad():
                tok = model(x, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
                for _ in range(3):
                    tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
                TIMER.clear()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
                total = time.perf_counter() - t0
            parts = ", ".join(f"{k.strip()} {v / args.steps * 1e3:.2f}" for k, v in TIMER.seconds.items())
            print(f"  round {r + 1}, {name} ({attention}): step {total / args.steps * 1e3:.1f}; {parts}", flush=True)
            if isinstance(cache, PagedCache):
                cache.release()
    model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()
