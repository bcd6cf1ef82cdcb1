"""The planning and observability subcommands of `hf-pagedkv`: ``plan``, ``tune-block-size`` and ``trace``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys

from hf_pagedkv.config import DEFAULT_BLOCK_SIZE, DEFAULT_QUANT_BLOCK_SIZE, PRESETS, QuantConfig, parse_bytes
from hf_pagedkv.errors import counted, install_hint
from hf_pagedkv.tools.models import DEFAULT_MODEL

# NOTE: torch, transformers and the planner (which imports both) are imported by the commands that use them, not
# here: `hf-pagedkv --help` and an argument error answer without loading them.
BLOCK_SIZE_CANDIDATES = (4, 8, 16, 32, 64, 128)  # `tune-block-size --candidates`; planning.BLOCK_SIZE_CANDIDATES

logger = logging.getLogger(__name__)

#: what --quant takes, for the subcommands' help
QUANT_HELP = (f"the ladder {', '.join(PRESETS)}, or k<b>v<b> with b in 16, 8, 4, 3, 2, e4m3, e5m2 and the "
              "suffixes r (rotated keys), v (rotated values), b (per-block fp8 scales), e.g. k4v4r, k8v4rv, k4ve4m3")


def quant_name(value: str) -> str:
    """An argparse `type` for --quant: `value` if `QuantConfig.preset` accepts it (torch-free), else an
    `argparse.ArgumentTypeError` naming the ladder and the suffix grammar."""
    try:
        QuantConfig.preset(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not a KV format; give {QUANT_HELP}") from e
    return value.lower()


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``plan``, ``tune-block-size`` and ``trace`` to the `hf-pagedkv` subcommands."""
    p = sub.add_parser("plan", help="KV bytes per token, total KV, weights, and the pool size for a workload")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="default model, local dir, config.json, .gguf, model type ('llama') or Hub id "
                        "(default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, required=True, help="tokens per sequence (prompt + generated)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once (default: %(default)s)")
    p.add_argument("--quant", default="fp", type=quant_name, metavar="FORMAT",
                   help=f"KV format: {QUANT_HELP} (default: %(default)s)")
    p.add_argument("--sliding-quant", default=None, type=quant_name, metavar="FORMAT",
                   help="KV format of the sliding-window layers, when it differs from --quant's, e.g. fp with "
                        "--quant k4v4 (BlockPool(quant={'sliding': ..., 'full': ...})) (default: --quant's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                   help="full-precision dtype of K/V and weights (default: auto = what "
                        "hf_pagedkv.tools.models.load_model uses for the bundled model, float32; else the config's "
                        "dtype, or float16)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: PagedCache's, 16, or 32 when quantized)")
    p.add_argument("--value-group-size", type=int, default=64,
                   help="channels per value quantization group (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (from_pretrained(..., tp_plan='auto') under torchrun): each rank holds "
                        "num_key_value_heads / tp KV heads, and the plan is one rank's (default: %(default)s)")
    p.add_argument("--memory", help="memory to fit in, one rank's device with --tp, e.g. 24GiB (default: CUDA device "
                                    "0's memory; without CUDA, this machine's RAM / --tp, as CPU ranks share it)")
    p.add_argument("--retention", metavar="SPEC", help="plan for a retention policy: each sequence holds at most "
                   "what it keeps, and the pool is sized for the peak: a prefill stores the whole prompt before the "
                   "first eviction (see --prefill-chunk), a compression writes the kept tokens next to it "
                   "(sink_window:SINK:WINDOW, or NAME:BUDGET|RATIO[:SHARE] with NAME one of key_norm, key_diff, "
                   "snapkv, pyramidkv, kv_zip, kv_zip_global, kv_zip_weighted; BUDGET: tokens kept, RATIO: a float "
                   "in (0, 1), the fraction removed, SHARE: the kept tokens' share given to the most recent ones)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="with --retention sink_window: plan for prompts prefilled in chunks of TOKENS tokens "
                        "(model.generate(..., prefill_chunk_size=TOKENS)), which the policy evicts between, so a "
                        "sequence never holds more than its sinks, window and one chunk (default: the whole prompt "
                        "in one forward step, stored in full before the first eviction: up to --max-seq-len tokens)")
    p.add_argument("--host-memory", help="a host-memory tier for offloaded caches and evicted prefix blocks, e.g. "
                                         "64GiB: prints the blocks, tokens and sequences it holds")
    p.add_argument("--prefix-cache-memory", default=None,
                   help="room for cached-idle prefix blocks on top of the sequences, e.g. 1GiB (default: none)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_plan)

    t = sub.add_parser("tune-block-size", help="fragmentation and block-table entries per block size, recommended")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="file of sequence lengths in tokens (whitespace/comma separated, or JSON)")
    src.add_argument("--text", help="text file to tokenize, one sample per --sample-by unit")
    src.add_argument("--dataset", help="a `datasets` name, or a local .json/.jsonl/.csv/.parquet file")
    t.add_argument("--sample-by", default="line", choices=["line", "paragraph", "document"],
                   help="how --text splits into samples (default: %(default)s)")
    t.add_argument("--split", default="train", help="--dataset split (default: %(default)s)")
    t.add_argument("--column", default="text", help="--dataset text column (default: %(default)s)")
    t.add_argument("--tokenizer", default=DEFAULT_MODEL, help="tokenizer for --text/--dataset (default: %(default)s)")
    t.add_argument("--max-samples", type=int, default=2000, help="samples tokenized at most (default: %(default)s)")
    t.add_argument("--new-tokens", type=int, default=0, help="tokens generated per sequence, added to each length")
    t.add_argument("--candidates", default=",".join(map(str, BLOCK_SIZE_CANDIDATES)),
                   help="block sizes to compare (default: %(default)s)")
    t.add_argument("--max-waste", type=float, default=0.05, help="fragmentation allowed (default: %(default)s)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(run=_tune)

    r = sub.add_parser("trace", help="read a block event dump: leaks, double frees, one block's refcount history")
    r.add_argument("file", help="JSONL written by pool.events.dump()")
    r.add_argument("--block", type=int, help="print this block's refcount history")
    r.add_argument("--limit", type=int, default=20, help="blocks listed per finding (default: %(default)s)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(run=_trace)
    for q in (p, t, r):
        q.add_argument("-v", "--verbose", action="store_true")


def check_pool_flags(parser: argparse.ArgumentParser, flags: str, **pool_kwargs) -> None:
    """Exit through `parser.error` (naming `flags`) when `BlockPool(**pool_kwargs)` would refuse the settings, before
    a command loads its model: first `PoolSettings.of` (sizes, block size; no torch import, so the error comes at
    once), then a `BlockPool` (the codecs' packing rules; imports torch; it holds no storage before a layer runs)."""
    from hf_pagedkv.pool.pool_settings import PoolSettings

    try:
        PoolSettings.of(**pool_kwargs)
        from hf_pagedkv.pool.block_pool import BlockPool

        BlockPool(**pool_kwargs)
    except ValueError as e:
        parser.error(f"{flags}: {e}")


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _machine_memory(tp: int = 1) -> tuple[int, str]:
    """Bytes one of `tp` ranks has, and a label: CUDA device 0's memory (each rank has its own device), else this
    machine's RAM divided by `tp` (CPU ranks share it)."""
    import torch

    from hf_pagedkv.pool.layer_registry import device_memory

    if torch.cuda.is_available():
        return device_memory(torch.device("cuda", 0)), f"{torch.cuda.get_device_name(0)} memory"
    ram = device_memory(torch.device("cpu"))
    return (ram, "this machine's RAM") if tp == 1 else (ram // tp, f"this machine's RAM / {tp} ranks")


def _auto_dtype(model: str) -> str:
    """float32 for the bundled model (`load_model` de-quantizes the GGUF to float32), else the config's dtype."""
    from hf_pagedkv.tools.planning import load_config

    if model in (None, DEFAULT_MODEL):
        return "float32"
    try:
        dtype = str(getattr(load_config(model), "dtype", None) or "").removeprefix("torch.")
    except ValueError:
        dtype = ""
    return dtype if dtype in ("float16", "bfloat16", "float32") else "float16"


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hf_pagedkv.tools.planning import _DTYPES, ModelShape, kv_heads_per_rank, load_config, plan_capacity

    for name in ("max_seq_len", "batch", "block_size", "value_group_size", "tp", "prefill_chunk"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    try:
        memory, where = ((parse_bytes(args.memory), "--memory" if args.tp == 1 else "--memory, one rank's")
                         if args.memory else _machine_memory(args.tp))
    except ValueError as e:
        parser.error(f"--memory {args.memory!r}: {e}")
    try:
        config = load_config(args.model)
        model = ModelShape.from_config(config, name=args.model)
    except ValueError as e:
        parser.error(str(e))
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < args.max_seq_len:  # generate and serve refuse such a sequence
        print(f"hf-pagedkv plan: warning: --max-seq-len {args.max_seq_len:,} is past the model's context of "
              f"{limit:,} tokens (config.max_position_embeddings), which `hf-pagedkv generate` refuses to pass: "
              f"the plan below sizes a pool for positions the model was not trained on (give --max-seq-len "
              f"{limit:,} or less)", file=sys.stderr)
    try:
        kv_heads_per_rank(model.num_kv_heads, args.tp)
    except ValueError as e:
        parser.error(f"--tp {args.tp}: {e}")
    if args.dtype == "auto":
        args.dtype = _auto_dtype(args.model)
    retention = None  # what the plan says of the policy (--json)
    chunk = getattr(args, "prefill_chunk", None)
    if chunk is not None and getattr(args, "retention", None) is None:
        parser.error(f"--prefill-chunk {chunk}: a chunked prefill bounds what a sequence holds only when a retention "
                     "policy evicts between the chunks; add --retention sink_window:SINK:WINDOW, or leave it out")
    if getattr(args, "retention", None) is not None:  # a retention policy bounds what each sequence holds
        from hf_pagedkv.retention.importance import ImportancePolicy
        from hf_pagedkv.retention.kv_zip import REPEAT_PROMPT_MAX_TOKENS
        policy = parse_retention_flag(args.retention, parser.error)
        fp = args.quant in (None, "fp") and getattr(args, "sliding_quant", None) in (None, "fp")
        default_block = DEFAULT_BLOCK_SIZE if fp else DEFAULT_QUANT_BLOCK_SIZE
        bound = policy.max_held(1, args.block_size or default_block)  # the block size the plan below uses
        ratio = getattr(policy, "compression_ratio", None)
        # (a ratio keeps at least its protected sinks and recent tokens, `ImportancePolicy.keep_for`)
        held = (bound if bound is not None else policy.keep_for(args.max_seq_len) + 1 if ratio is not None
                else args.max_seq_len)  # SnapKV(budget=...): the prompt is compressed once, what follows is kept
        # what the cache refuses for this model, refused here too (before any plan)
        least = (policy.sink_tokens + policy.window - 1 if not isinstance(policy, ImportancePolicy)  # SinkWindow
                 else policy.keep_for(args.max_seq_len))  # after a compaction
        if model.num_sliding and policy.reconstructs:
            parser.error(f"--retention {args.retention}: KVzip is not supported on models with sliding-window "
                         "layers (its reconstruction pass would move their windows); use snapkv, pyramidkv, key_diff, "
                         "key_norm or sink_window")
        need = min(args.max_seq_len, model.sliding_window - 1) if model.num_sliding else 0
        if least < need:
            parser.error(f"--retention {args.retention}: keeps as few as {least:,} tokens, but this model's "
                         f"sliding-window layers read the last {model.sliding_window - 1:,}; on a hybrid model the "
                         f"full-attention layers must keep at least window - 1 tokens, here {need:,} (the sequence's "
                         "length if shorter): a larger budget, window or a smaller ratio")
        try:
            policy.layer_tiers(model.num_layers - model.num_sliding)  # PyramidKV: enough full-attention layers
        except ValueError as e:  # (the command line's pyramidkv has 4 tiers; fewer are set in Python)
            fewer = "build PyramidKV(tiers=...) with fewer tiers in Python, or use snapkv"
            parser.error(f"--retention {args.retention}: {str(e).replace('lower `tiers`', fewer)}")
        L = args.max_seq_len
        say = print if not args.json else (lambda *a, **k: None)  # (--json prints the JSON only)
        kept = policy.keep_for(L) if isinstance(policy, ImportancePolicy) else L  # of a prompt of L tokens
        if held < L:
            when = "once compressed" if isinstance(policy, ImportancePolicy) else "(its sinks and window)"
            say(f"retention {policy}: each sequence of {L:,} tokens holds at most {held:,} {when}")
        elif bound is None and ratio is None and kept < L:  # a one-shot budget (SnapKV, KVzip): what follows is kept
            say(f"retention {policy}: the prompt is compressed once, to {policy.budget:,} tokens per layer and KV "
                f"head on average; the tokens generated after it are kept, so a sequence may hold all {L:,}")
        elif kept >= L:
            say(f"retention {policy}: keeps every token of a sequence of {L:,}: it evicts nothing at this length")
        peak = min(held, L)
        if chunk is not None and isinstance(policy, ImportancePolicy):
            parser.error(f"--prefill-chunk {chunk}: {policy.name} compresses the prompt as stored, so chunks do not "
                         "bound its peak; --prefill-chunk applies to --retention sink_window, or leave it out")
        if not isinstance(policy, ImportancePolicy) and held < L:
            # NOTE: SinkWindow evicts before each forward step, and a prefill is one step: it stores the whole prompt
            # (which may be all of --max-seq-len) before the first eviction. A chunked prefill is one step per chunk,
            # each evicting first: at most the sinks, the window and one chunk (`SinkWindow.max_held`).
            if chunk is None:
                peak = L
                say(f"a prefill stores its whole prompt before the first eviction: the plan below is sized for a "
                    f"prompt of up to --max-seq-len = {L:,} tokens (with model.generate(..., "
                    "prefill_chunk_size=N), plan with --prefill-chunk N: the policy evicts between the chunks)")
            else:
                peak = min(L, policy.max_held(chunk, args.block_size or default_block))
                say(f"a prefill in chunks of {chunk:,} tokens (model.generate(..., prefill_chunk_size={chunk})) "
                    f"evicts between them: a sequence holds at most {peak:,} tokens at any step, the plan below is "
                    "sized for that (a prefill in one step would store the whole prompt)")
        # The worst case is a prompt of max_seq_len tokens, budget or ratio alike. KVzip's reconstruction pass holds
        # the context, the repeat prompt and the context again (whatever the budget: it runs even if nothing is
        # evicted), then crops back to the context before the compaction, which needs less. Another importance
        # policy's prefill holds the whole prompt, and the compaction writes the kept tokens (and the step's token)
        # into fresh blocks before it frees the old ones. (SinkWindow drops whole blocks: no peak beyond its bound.)
        if policy.reconstructs:
            peak = 2 * L + REPEAT_PROMPT_MAX_TOKENS
            say(f"while it compresses, a sequence holds up to {peak:,} tokens (the reconstruction pass: the whole "
                f"prompt twice and the built-in repeat instruction, up to {REPEAT_PROMPT_MAX_TOKENS} tokens; a longer "
                "`prompt_ids` needs as many more): the plan below is sized for that peak")
        elif kept < L:
            peak = L + kept + 1
            say(f"while it compresses, a sequence holds up to {peak:,} tokens (the whole prompt plus the kept "
                "tokens in fresh blocks): the plan below is sized for that peak")
        retention = {"policy": str(policy), "spec": args.retention, "max_seq_len": L, "held": min(held, L),
                     "peak": peak, "prefill_chunk": chunk}
        args.max_seq_len = peak
    try:
        plan = plan_capacity(model, args.max_seq_len, args.batch, quant=_quant(args, args.quant),
                             dtype=args.dtype, block_size=args.block_size, value_group_size=args.value_group_size,
                             memory=memory, tp=args.tp, prefix_cache_memory=args.prefix_cache_memory)
    except ValueError as e:  # a block size or value group the codecs cannot pack; a bad --prefix-cache-memory
        parser.error(f"--prefix-cache-memory {args.prefix_cache_memory}: {e}" if "prefix_cache" in str(e)
                     else f"--quant {args.quant}: {e}")
    host = _host_tier(plan, args.host_memory, parser) if args.host_memory else None
    if args.json:
        extra = {**({"host_tier": host} if host else {}), **({"retention": retention} if retention else {})}
        print(json.dumps({**plan.to_dict(), **extra}, indent=2))  # (with retention, max_seq_len is its peak)
        return 0 if plan.fits else 1
    m = model
    sliding = f", {m.num_sliding} of them sliding-window ({m.sliding_window} tokens)" if m.num_sliding else ""
    params = f", {m.num_params / 1e6:,.1f}M parameters" if m.num_params else ""
    print(f"model: {m.name}: {counted(m.num_layers, 'layer')} store K/V{sliding}, "
          f"{counted(m.num_kv_heads, 'KV head')}, head_dim {m.head_dim}{params}")
    rank = " per rank" if plan.tp > 1 else ""
    if plan.tp > 1:
        print(f"tensor parallel: {plan.tp} ranks, each holds {plan.kv_heads_per_rank} of the {m.num_kv_heads} KV "
              f"heads; bytes below are per rank (the job holds {plan.tp}x)")
    codes = "integer or fp8 codes" if re.search(r"e[45]m[23]", plan.quant or "") else "integer codes"
    dtype = (f"{codes} with fp16 scales; {plan.dtype} where kept in full precision"
             if plan.quant not in (None, "fp") else plan.dtype)  # (`QuantConfig`: codes and fp16 scales)
    print(f"KV format: {plan.quant} ({dtype}), block_size {plan.block_size}")
    per_head = plan.bytes_per_token / (m.num_layers * plan.kv_heads_per_rank)
    print(f"bytes per token{rank}: {plan.bytes_per_token:,.0f} B ({fmt_bytes(plan.bytes_per_token)}) = "
          f"{m.num_layers} layers x {plan.kv_heads_per_rank} KV heads x {per_head:,.1f} B (K+V of head_dim "
          f"{m.head_dim})")
    print(f"per sequence{rank}: {counted(plan.max_seq_len, 'token', spec=',')} -> {fmt_bytes(plan.seq_bytes)}")
    note = (f" (sliding-window layers hold the blocks of their window; exactly the windows, as "
            f"DynamicCache(config): {fmt_bytes(plan.window_kv_bytes)})") if m.num_sliding else ""
    print(f"total KV{rank}: batch {plan.batch} -> {fmt_bytes(plan.kv_bytes)}{note}")
    if plan.weight_bytes is not None:
        per_param = _DTYPES[plan.dtype].itemsize
        split = f" / {plan.tp} ranks (norms, replicated, not counted)" if plan.tp > 1 else ""
        print(f"weights{rank}: {m.num_params / 1e6:,.1f}M parameters x {per_param} B{split} = "
              f"{fmt_bytes(plan.weight_bytes)}")
    else:
        print("weights: unknown (could not count the parameters of this architecture)")
    quant = "" if plan.quant == "fp" else f", quant={_quant(args, args.quant)!r}"
    prefix = ""
    if plan.prefix_cache_bytes:
        print(f"prefix cache{rank}: {fmt_bytes(plan.prefix_cache_bytes)} of cached-idle blocks, in the pool below")
        prefix = f", prefix_caching=True, prefix_cache_memory={plan.prefix_cache_bytes}"
    print(f"pool to set{rank} (peak x 1.2{' + prefix cache' if prefix else ''}): {plan.pool_blocks:,} blocks, "
          f"{fmt_bytes(plan.pool_bytes)} -> BlockPool(block_size={plan.block_size}{quant}, "
          f"max_memory={plan.pool_max_memory}{prefix})")
    if plan.num_stages:  # quantized: the full-precision stages sit inside max_memory
        print(f"  (max_memory holds {plan.num_stages:,} full-precision stages of {fmt_bytes(plan.stage_bytes)}, the "
              f"partial last blocks of {counted(plan.num_stages // 2, 'row')} at once, and {plan.pool_blocks:,} "
              f"encoded blocks of {fmt_bytes(plan.block_bytes)} with room for their sink tokens)")
    if host:
        print(f"host tier: {fmt_bytes(host['bytes'])} -> {host['blocks']:,} blocks = {host['tokens']:,} tokens = "
              f"{host['sequences']:,} sequences of {plan.max_seq_len:,} tokens offloaded -> "
              f"BlockPool(..., host_memory={host['bytes']})")
    need = (plan.weight_bytes or 0) + plan.pool_bytes
    if plan.fits:
        print(f"memory: {fmt_bytes(memory)} ({where}): fits, weights + pool = {fmt_bytes(need)} "
              f"({need / memory:.0%})")
        return 0
    free_for_kv = memory - (plan.weight_bytes or 0)
    per_seq = plan.seq_bytes * 1.2
    max_batch = max(0, int(free_for_kv // per_seq))
    print(f"memory: {fmt_bytes(memory)} ({where}): does NOT fit: weights + pool = {fmt_bytes(need)} needed, "
          f"{fmt_bytes(memory)} available.")
    fixes = [f"--batch {max_batch}" if max_batch else "a smaller model or more memory"]
    ladder = list(PRESETS)  # the formats after --quant's on the ladder (all of it for a name off the ladder)
    for preset in ladder[ladder.index(args.quant) + 1 if args.quant in ladder else 0:]:
        alt = plan_capacity(model, args.max_seq_len, args.batch, quant=_quant(args, preset), dtype=args.dtype,
                            block_size=args.block_size, value_group_size=args.value_group_size, memory=memory,
                            tp=args.tp, prefix_cache_memory=args.prefix_cache_memory)
        if alt.fits and alt.pool_bytes < plan.pool_bytes:
            fixes.append(f"--quant {preset} ({fmt_bytes(alt.pool_bytes)} pool)")
            break
    print("change: " + ", or ".join(fixes))
    return 1


def _quant(args, full: str) -> str | dict:
    """`plan_capacity`'s `quant` for `full` as the full-attention layers' preset and `--sliding-quant`: `full`
    itself, or ``{"sliding": ..., "full": full}`` when they differ."""
    sliding = getattr(args, "sliding_quant", None)
    return full if sliding is None or sliding == full else {"sliding": sliding, "full": full}


def _host_tier(plan, host_memory: str, parser) -> dict:
    """What a `BlockPool(host_memory=...)` tier holds for this plan: blocks (`pool/host_tiers.py` sizes it as
    ``host_memory // bytes per block``), tokens, and sequences of `max_seq_len`."""
    try:
        size = parse_bytes(host_memory, name="host_memory")
    except ValueError as e:
        parser.error(f"--host-memory: {e}")
    block_bytes = plan.bytes_per_token * plan.block_size
    blocks = int(size // block_bytes)
    if blocks == 0:  # BlockPool(host_memory=...) would refuse it at the first offload
        parser.error(f"--host-memory {host_memory}: {size:,} bytes holds no block: one block of "
                     f"{counted(plan.block_size, 'token')} takes {math.ceil(block_bytes):,} bytes in this "
                     f"format; give at least {math.ceil(block_bytes):,} bytes ({fmt_bytes(math.ceil(block_bytes))}), "
                     "or leave it out for no host tier.")
    per_seq = -(-plan.max_seq_len // plan.block_size)
    return {"bytes": size, "blocks": blocks, "tokens": blocks * plan.block_size, "sequences": blocks // per_seq}


def _read_lengths(path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (FileNotFoundError, IsADirectoryError):
        raise ValueError(f"--lengths {path}: no such file; give a text file of sequence lengths.") from None
    except UnicodeDecodeError:
        raise ValueError(f"--lengths {path}: not a UTF-8 text file; give integers (tokens) separated by whitespace "
                         "or commas, or a JSON list.") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        return [int(v) for v in values]
    except ValueError as e:
        raise ValueError(f"--lengths {path}: expected integers (tokens) separated by whitespace or commas, or a "
                         f"JSON list ({e}).") from e


def _texts(args: argparse.Namespace) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("--text/--dataset need the `datasets` package: "
                          f"{install_hint('planning', repr('datasets>=2.19'))}") from e

    datasets.disable_progress_bars()
    if args.text:
        if not os.path.isfile(args.text):
            raise ValueError(f"--text {args.text}: no such file; give a UTF-8 text file to tokenize.")
        if os.path.getsize(args.text) == 0:
            return []
        try:
            ds = datasets.load_dataset("text", data_files=args.text, sample_by=args.sample_by, split="train")
        except datasets.exceptions.DatasetGenerationError as e:  # e.g. bytes that are not UTF-8
            raise ValueError(f"--text {args.text}: could not be read as UTF-8 text ({e.__cause__ or e}).") from e
        column = "text"
    else:
        ext = os.path.splitext(args.dataset)[1].lstrip(".")
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(ext)
        ds = (datasets.load_dataset(builder, data_files=args.dataset, split="train") if builder and
              os.path.isfile(args.dataset) else datasets.load_dataset(args.dataset, split=args.split))
        column = args.column
        if column not in ds.column_names:
            raise ValueError(f"--column {column!r} is not in the dataset; columns: {ds.column_names}")
    texts = [t for t in ds[column][: args.max_samples * 4] if isinstance(t, str) and t.strip()]
    return texts[: args.max_samples]


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from hf_pagedkv.tools.models import GGUF_FILE, default_model_dir

    if name == DEFAULT_MODEL:
        return AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=GGUF_FILE)
    return AutoTokenizer.from_pretrained(name)


def _tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hf_pagedkv.tools.planning import tune_block_size

    try:
        candidates = tuple(int(c) for c in args.candidates.split(","))
        if args.lengths:
            lengths, source = _read_lengths(args.lengths), args.lengths
        else:
            texts = _texts(args)
            if not texts:
                raise ValueError("no non-empty text samples found")
            tok = _tokenizer(args.tokenizer)
            lengths = [len(ids) for ids in tok(texts, add_special_tokens=True)["input_ids"]]
            source = f"{len(texts)} samples of {args.text or args.dataset}, {args.tokenizer} tokenizer"
        if args.new_tokens < 0:
            raise ValueError(f"--new-tokens must be >= 0, got {args.new_tokens}")
        lengths = [n + args.new_tokens for n in lengths]
        rows, best, reason = tune_block_size(lengths, candidates, args.max_waste)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps({"source": source, "rows": [r.__dict__ for r in rows], "recommended": best,
                          "reason": reason}, indent=2))
        return 0
    s = sorted(lengths)
    print(f"{len(lengths)} sequences ({source}): tokens min {s[0]}, median {s[len(s) // 2]}, max {s[-1]}"
          f"{f' (each + {args.new_tokens} generated)' if args.new_tokens else ''}")
    print(f"{'block_size':>10} {'fragmentation':>14} {'entries/seq':>12} {'max entries':>12}")
    for r in rows:
        mark = "  <- recommended" if r.block_size == best else ""
        print(f"{r.block_size:>10} {r.fragmentation:>14.1%} {r.mean_entries:>12.1f} {r.max_entries:>12}{mark}")
    print(f"recommended block_size={best}: {reason}")
    return 0


def _trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from hf_pagedkv.observe.trace import analyze, format_report, read_trace

    try:
        header, records = read_trace(args.file)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    report = analyze(records, header)
    if args.json:
        out = {"events": report.num_events, "never_freed": report.never_freed,
               "double_frees": [{"n": h.n, "block": h.block} for h in report.double_frees],
               "anomalies": report.anomalies}
        if args.block is not None:
            out["history"] = [{"n": h.n, "kind": h.kind, "before": h.before, "after": h.after}
                              for h in report.histories.get(args.block, [])]
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report, block=args.block, limit=args.limit))
    return 0 if report.ok else 1


def parse_retention_flag(spec: str, error):
    """The policy `--retention SPEC` names (`parse_retention`); a bad spec goes to `error` (an argparse parser's or
    group's `error`, which exits) with the message naming the flag."""
    from hf_pagedkv.retention.spec import parse_retention

    try:
        return parse_retention(spec)
    except ValueError as e:
        error(str(e).replace("retention spec", "--retention", 1))


def run_tool(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run a subcommand added by `add_tool_commands` (or `serve`); Ctrl-C ends it with one line and status 130 (the
    shell's status for SIGINT), not a traceback."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    try:
        return args.run(args, parser)
    except KeyboardInterrupt:
        print(f"hf-pagedkv {args.command}: interrupted", file=sys.stderr)
        return 130
