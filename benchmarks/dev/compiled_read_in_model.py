"""The compiled quantized read on the model's own codes: one layer's read captured from a SmolLM2 decode step.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/compiled_read_in_model.py --tokens 2048 --batch 1 --quant k4v4

Prefills `--tokens` random tokens per row into a quantized `PagedCache` with ``attn_implementation=
"hf_pagedkv_compiled"``, runs three decode steps, and keeps the last layer's read (`CodeRead`: views of the pool for
a batch-1 row in consecutive blocks). Then, one thread, best of `--reps` rounds of `--calls` calls, microseconds per
call: the compiled function (`CompiledCodeAttention`, as the attention calls it) and the eager `code_attention` on
that read, on contiguous copies of its codes and scales, and on the micro-benchmark's random read of the same size
(`benchmarks/dev/code_attention_parts.make_read`); and the fixed cost per call of what wraps a compiled call: the two
config patches that let it compile, and the ``fail_on_recompile`` stance a call with a graph takes instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.fx.experimental._config  # noqa: F401  (torch.fx.experimental._config.patch below)

import hf_pagedkv.attention.attention_function as attention_function
from benchmarks.dev.code_attention_parts import best, make_read
from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.attention.compiled_read import CompiledCodeAttention
from hf_pagedkv.tools.models import load_model

code_attention = sys.modules["hf_pagedkv.attention.paged_attention"].code_attention


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quant", default="k4v4", help="k8v8, k8v4 or k4v4")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    captured = []
    call = CompiledCodeAttention.__call__

    def capture(self, qh, read, bias):
        captured[:] = [(qh, read, bias)]
        return call(self, qh, read, bias)

    CompiledCodeAttention.__call__ = capture
    model, _ = load_model()
    model.set_attn_implementation("hf_pagedkv_compiled")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(100, model.config.vocab_size, (args.batch, args.tokens), generator=g)
    cache = PagedCache(config=model.config, quant=args.quant)
    with torch.no_grad():
        tok = model(x, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        for _ in range(3):
            tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    CompiledCodeAttention.__call__ = call
    qh, read, bias = captured[0]
    reader = attention_function.COMPILED_READ
    kbits, vbits = (int(b) for b in args.quant[1:].split("v"))
    random_read = make_read(kbits, vbits, args.tokens, args.batch)
    print(f"{args.quant}, {args.tokens} tokens, batch {args.batch}: one layer's read, us per call (best of "
          f"{args.reps} x {args.calls}, one thread)")
    print(f"  sink tokens in the read: {max(0, read.sink_end - read.lo)}; random read: tokens {random_read.end}, "
          f"sink {random_read.sink_end}")
    for name, t in zip(("key codes", "value codes"), read.codes):
        print(f"  {name}: shape {tuple(t.shape)}, strides {t.stride()}, contiguous {t.is_contiguous()}")
    copies = read._replace(codes=tuple(c.contiguous() for c in read.codes),
                           scales=tuple(c.contiguous() for c in read.scales))
    for label, r in (("the model's read", read), ("contiguous copies", copies), ("random codes", random_read)):
        b = bias if r is not random_read else None
        print(f"  {label}: compiled {best(lambda: reader(qh, r, b), args.calls, args.reps):.1f}, "
              f"eager {best(lambda: code_attention(qh, r, b, 2048), args.calls, args.reps):.1f}")

    def patches():
        with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._dynamo.config.patch(recompile_limit=32):
            pass

    def stance():
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
            pass

    print(f"  calls that compiled (or found a graph): {reader.compile_calls}")
    print(f"  the config patches of a compiling call: {best(patches, 200, args.reps):.1f}; "
          f"the stance of a call with a graph: {best(stance, 200, args.reps):.1f}")
    cache.release()


if __name__ == "__main__":
    main()
