"""Decode speed of this checkout against an earlier commit, interleaved in one run (CPU time, SmolLM2).

    python benchmarks/dev/decode_ab.py --base main                      # fp and k8v4 at 512, 2048, 4096 tokens
    python benchmarks/dev/decode_ab.py --base HEAD~3 --lengths 512 --rounds 1 --steps 8     # a smoke run

The base commit is checked out with `git worktree add --detach` into a temporary folder; each round runs one child
process per side (base, then this checkout, alternating which goes first), each loading the bundled model once and
timing `--steps` greedy decode steps (`model(next_token, past_key_values=cache)`) after an untimed prefill, for every
length and cache. Times are this process's CPU time (`time.process_time`), steadier than wall time on a shared
machine; the best of the rounds is kept. Prints a table of tokens/s and new/base ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(lengths: list[int], methods: list[str], steps: int, threads: int) -> None:
    """Run in a child process whose `sys.path` starts with one side's checkout; prints one JSON line per case."""
    import torch

    torch.set_num_threads(threads)
    from hf_pagedkv import PagedCache
    try:
        from hf_pagedkv.tools.models import load_model
    except ImportError:  # a base commit whose model loader is hf_pagedkv.models
        from hf_pagedkv.models import load_model

    model, _ = load_model()
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        x = torch.randint(100, model.config.vocab_size, (1, n), generator=g)
        for method in methods:
            cache = PagedCache(config=model.config, quant=None if method == "fp" else method)
            with torch.no_grad():
                logits = model(x, past_key_values=cache).logits[:, -1:]
                tok = logits.argmax(-1)
                model(tok, past_key_values=cache)  # warm-up step
                t0 = time.process_time()
                for _ in range(steps):
                    tok = model(tok, past_key_values=cache).logits[:, -1:].argmax(-1)
                dt = time.process_time() - t0
            cache.release()
            print(json.dumps({"length": n, "method": method, "tok_s": steps / dt}), flush=True)


def run_side(path: Path, args) -> list[dict]:
    """One child process with `path`'s hf_pagedkv first on its path (this file's `child` runs the cases). The
    child passes `past_key_values=` (the base commit may predate `cache_kwargs`; transformers 5.24 warns, no more)."""
    env = {**os.environ, "PYTHONPATH": str(path), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--lengths", args.lengths,
           "--methods", args.methods, "--steps", str(args.steps), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, cwd=path, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the commit (or branch) to compare this checkout against (required)")
    ap.add_argument("--lengths", default="512,2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--methods", default="fp,k8v4", help="PagedCache quant presets ('fp' = full precision)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the best per case is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    methods = args.methods.split(",")
    if args.child:
        child(lengths, methods, args.steps, args.threads)
        return 0
    if not args.base:
        ap.error("--base is required: the commit (or branch) to compare this checkout against")
    best: dict[tuple, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            for r in range(args.rounds):
                sides = [("base", base), ("new", ROOT)]
                for name, path in sides if r % 2 == 0 else sides[::-1]:
                    for rec in run_side(path, args):
                        key = (name, rec["length"], rec["method"])
                        best[key] = max(best.get(key, 0.0), rec["tok_s"])
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"decode tokens/s (CPU time, {args.threads} thread(s), best of {args.rounds} rounds, {args.steps} steps), "
          f"base {args.base} vs this checkout")
    print("| tokens | cache | base tok/s | new tok/s | new / base |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n in lengths:
        for m in methods:
            b, a = best[("base", n, m)], best[("new", n, m)]
            print(f"| {n} | {m} | {b:.2f} | {a:.2f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
