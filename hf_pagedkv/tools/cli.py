"""The `hf-pagedkv` command. `hf-pagedkv generate` runs the default model through a PagedCache and reports."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from hf_pagedkv.tools.cli_tools import (QUANT_HELP, add_tool_commands, check_pool_flags, parse_retention_flag,
                                        quant_name, run_tool)
from hf_pagedkv.tools.serve_command import add_serve_command
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.errors import EMPTY_PROMPT, counted
from hf_pagedkv.tools.models import DEFAULT_MODEL, chat_prompt, default_document, load_model, missing_model_path

# NOTE: torch and transformers are imported where a command needs them, not here: `hf-pagedkv --help`, a
# subcommand's --help and an argument error answer in a fraction of a second instead of after seconds of imports.

MiB = 2**20
PREFILL_NOTICE_TOKENS = 1024  # prompts at least this long get a "prefilling N tokens" line on stderr first


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import set_seed

    from hf_pagedkv._compat import cache_kwargs
    from hf_pagedkv.adapter.paged_cache import PagedCache
    from hf_pagedkv.tools.verify import dynamic_cache_bytes

    text = args.file_text  # read (and checked) by `main` before the model loaded
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        model, tokenizer = load_model(args.model)
    except ValueError as e:
        print(f"hf-pagedkv generate: --model: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # the default model (a GGUF file) without the `demo` extra: what to install, no traceback
        print(f"hf-pagedkv generate: --model {args.model}: {e}", file=sys.stderr)
        return 2
    if args.prompt is not None:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) if args.chat
                  else args.prompt)
        source = "--prompt"
    elif args.file is not None:
        prompt = chat_prompt(tokenizer, args.file, text)
        source = args.file
    else:
        title, text = default_document()
        prompt, source = chat_prompt(tokenizer, title, text), f"a request to summarise {title}"
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    if input_ids.shape[1] == 0:  # text the tokenizer turns into no token at all
        print(f"hf-pagedkv generate: {source}: {EMPTY_PROMPT} (some text)", file=sys.stderr)
        return 2
    refusal = _beyond_context(model, tokenizer, input_ids.shape[1], args, source)
    if refusal is not None:  # before any forward: a prompt past the model's context only wastes minutes and memory
        print(f"hf-pagedkv generate: {refusal}", file=sys.stderr)
        return 2
    if input_ids.shape[1] >= PREFILL_NOTICE_TOKENS:  # the first output comes after the whole prompt's forward
        print(f"hf-pagedkv generate: {_prefill_notice(model, input_ids.shape[1], args)}", file=sys.stderr, flush=True)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, return_dict_in_generate=True,
               output_logits=True)
    if args.do_sample:  # None keeps the model's generation_config
        gen.update({k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None})

    quant = QuantConfig.resolve(args.quant)
    retention = args.retention_policy  # parsed (and checked) by `main` before the model loaded
    model.set_attn_implementation(args.attention)  # (hf_pagedkv for SnapKV, KVzip: it hands the queries to the cache)
    cache = PagedCache(block_size=args.block_size, config=model.config, quant=quant, retention=retention)
    t0 = time.perf_counter()
    compressing = 0.0  # seconds of KVzip's prefill and reconstruction pass, inside the total
    set_seed(args.seed)  # the same seed for the --check run: sampling draws the same tokens from the same logits
    with torch.inference_mode():
        if retention is not None and retention.reconstructs and input_ids.shape[1] > 1:
            # KVzip: the prompt but its last token is the context, compressed once; generate feeds the last token
            from hf_pagedkv.adapter.compress import compress_context

            model(input_ids[:, :-1], **cache_kwargs(cache), logits_to_keep=1)
            compress_context(model, cache, input_ids[:, :-1], tokenizer=tokenizer)
            compressing = time.perf_counter() - t0
        out = model.generate(input_ids, **cache_kwargs(cache), **gen)
    seconds = time.perf_counter() - t0
    new_tokens = out.sequences[0, input_ids.shape[1]:]
    print(tokenizer.decode(new_tokens, skip_special_tokens=True).strip())
    print()
    stats = cache.pool.stats()
    print(f"prompt: {counted(input_ids.shape[1], 'token')} ({source}); generated {counted(len(new_tokens), 'token')} "
          f"in {seconds:.1f} s ({len(new_tokens) / seconds:.1f} tokens/s"
          + (f"; {compressing:.1f} s of it the prefill and KVzip's reconstruction pass)" if compressing else ")"))
    cached = cache.get_seq_length()
    kept = cache.retention_stats()
    mean = " (the mean over layers)" if kept.tokens_held_per_layer else ""
    if retention is not None:
        print(f"retention {retention}: {kept.tokens_held} of {kept.tokens_seen} tokens held{mean} "
              f"({counted(kept.num_evictions, 'eviction')})")
    fmt = f" ({quant.name})" if quant.is_quantized else ""
    groups = f" in {cache.num_layer_groups} layer groups" if cache.num_layer_groups > 1 else ""  # (summed over them)
    print(f"PagedCache{fmt}: {counted(stats.blocks_in_use, 'block')} of {counted(stats.block_size, 'token')}{groups} "
          f"for {cached} cached tokens, {stats.bytes_in_use / MiB:.1f} MiB held "
          f"({stats.bytes_in_use / max(cached, 1) / 1024:.1f} KiB/token), fragmentation {stats.fragmentation:.1%}, "
          f"pool reserved {stats.bytes_reserved / MiB:.1f} MiB")
    status = 0
    if args.check:
        from transformers import DynamicCache

        ref_cache = DynamicCache(config=model.config)
        set_seed(args.seed)
        with torch.inference_mode():
            ref = model.generate(input_ids, **cache_kwargs(ref_cache), **gen)
        ref_bytes = dynamic_cache_bytes(ref_cache)
        same = torch.equal(ref.sequences, out.sequences)
        diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
        print(f"DynamicCache would hold {ref_bytes / MiB:.1f} MiB: PagedCache holds "
              f"{stats.bytes_in_use / ref_bytes:.3f}x")
        lossy = [f"--quant {quant.name}: quantized K/V"] if quant.is_quantized else []
        evicted = kept.tokens_evicted if retention is not None else 0
        if evicted:
            lossy += [f"--retention {args.retention}: {evicted} of {kept.tokens_seen} tokens evicted{mean}"]
        # nothing evicted, yet not the reference's steps: float rounding only (so a token may differ, rarely)
        elif retention is not None and retention.reconstructs:  # prefill, KVzip's pass, then generate
            lossy += [f"--retention {args.retention}: nothing evicted, but the context prefilled in a step of its own"]
        elif args.attention != "sdpa":
            lossy += [f"--attention {args.attention}: reads the cache in place, its sums in another order"]
        expected = f" (expected with {'; '.join(lossy)})" if lossy and diff > 0 else ""
        print(f"check: generated tokens {'IDENTICAL to' if same else 'DIFFERENT from'} DynamicCache's "
              f"({counted(ref.sequences.shape[1] - input_ids.shape[1], 'token')}), max |logit difference| "
              f"{diff:.3g}{expected}")
        status = 0 if same or lossy else 1  # unquantized and nothing evicted, any difference is a bug
    cache.release()
    return status


def _prompt_error(args: argparse.Namespace) -> str | None:
    """Why the prompt flags cannot give a prompt (a --file that is missing, not text or empty; an empty raw
    --prompt), or None; reads --file into `args.file_text` (None without --file). Needs no import: `main` calls it
    before torch, transformers and the model load."""
    args.file_text = None
    if args.file is not None and not os.path.isfile(args.file):
        return f"--file {args.file!r} is not a readable file"
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                args.file_text = fh.read()
        except UnicodeDecodeError as e:
            return f"--file {args.file!r} is not UTF-8 text ({e.reason} at byte {e.start}); give a text file"
        except OSError as e:
            return f"--file {args.file!r} cannot be read ({e.strerror}); give a readable text file"
        if not args.file_text.strip():
            return f"--file {args.file!r} holds no text: {EMPTY_PROMPT} (a file with some text)"
    if args.prompt is not None and not args.prompt.strip() and not args.chat:
        return f"--prompt is empty and --no-chat adds no template: {EMPTY_PROMPT} (some text)"
    return None


def _beyond_context(model, tokenizer, prompt_tokens: int, args: argparse.Namespace, source: str) -> str | None:
    """Why the run would reach past the model's context (`config.max_position_embeddings`), or None.

    The positions a run reaches: the prompt and `--max-new-tokens`; with a reconstruction policy (KVzip) also its
    reconstruction pass, which feeds the repeat instruction and the context (the prompt but its last token) again
    after the context, at the positions that follow it. A retention policy does not extend the reach: the tokens it
    keeps keep their positions, and each new token takes the next one.
    """
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    new = args.max_new_tokens
    context = f"the model's context of {limit:,} tokens (config.max_position_embeddings)"
    if prompt_tokens + new > limit:
        room = limit - prompt_tokens  # new tokens that fit after this prompt
        shorter = f"a shorter {_source_option(args)}"
        fixes = [f"give at most {limit - new:,} prompt tokens ({shorter})"] if new < limit else []
        if room > 0:
            fixes.append(f"lower --max-new-tokens to at most {room:,} (the context minus this prompt's tokens)")
        elif new >= limit:
            fixes.append(f"give {shorter} and lower --max-new-tokens: the two together at most {limit:,} tokens")
        fix = " or ".join(fixes)
        return (f"{source}: the prompt is {counted(prompt_tokens, 'token', spec=',')} and --max-new-tokens {new:,} "
                f"takes the sequence to {prompt_tokens + new:,} positions, past {context}: {fix}.")
    policy = args.retention_policy
    if policy is not None and policy.reconstructs and prompt_tokens > 1:
        from hf_pagedkv.adapter.compress import repeat_prompt_ids

        repeat = len(repeat_prompt_ids(tokenizer))
        reach = 2 * (prompt_tokens - 1) + repeat  # the context, the repeat instruction, the context again
        if reach > limit:
            most = (limit - repeat) // 2 + 1
            return (f"{source}: --retention {args.retention} runs KVzip's reconstruction pass, which feeds the "
                    f"context again after it: the prompt's {prompt_tokens:,} tokens reach {reach:,} positions (the "
                    f"context, {prompt_tokens - 1:,} tokens, twice and the {repeat}-token repeat instruction), past "
                    f"{context}: give at most {most:,} prompt tokens (a shorter {_source_option(args)}), or a "
                    "policy without a reconstruction pass (snapkv, pyramidkv, key_diff, key_norm, sink_window).")
    return None


def _source_option(args: argparse.Namespace) -> str:
    return "--file" if args.file is not None else "--prompt" if args.prompt is not None else "--file or --prompt"


def _prefill_notice(model, prompt_tokens: int, args: argparse.Namespace) -> str:
    """The line said before a long prefill: its tokens, and about how much K/V it stores (when the planner can tell).
    NOTE: the prefill runs as one forward step, as `DynamicCache`'s does: chunking it would change the outputs (sums
    in another order; a retention policy would evict between the chunks), so progress within it is not shown."""
    from hf_pagedkv.tools.cli_tools import fmt_bytes
    from hf_pagedkv.tools.planning import ModelShape, plan_capacity

    kv = ""
    try:
        dtype = str(model.dtype).removeprefix("torch.")
        shape = ModelShape.from_config(model.config)
        per_token = plan_capacity(shape, prompt_tokens, 1, quant=args.quant, dtype=dtype,
                                  block_size=args.block_size).bytes_per_token
        kv = f", about {fmt_bytes(prompt_tokens * per_token)} of K/V"
    except ValueError:  # a dtype or a layer type the planner does not count: the notice without the size
        pass
    evicted = " before the retention policy evicts" if args.retention_policy is not None else ""
    return (f"prefilling {prompt_tokens:,} prompt tokens in one forward step{kv}{evicted}; the generated text comes "
            "after it")


def _eval(argv: list[str]) -> int:
    """`hf-pagedkv eval ...`: the drift suite, `python -m eval.drift ...`. eval/ is a folder of the repository, not an
    installed package: it is found beside hf_pagedkv/ (a clone, or an editable install of one), else in the working
    directory (a clone's root)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "eval" / "drift.py").is_file() and str(root) not in sys.path:
            sys.path.append(str(root))
            break
    try:
        from eval.drift import main as eval_main
    except ImportError as exc:
        print(f"hf-pagedkv eval: needs the repository's eval/ folder and its extra ({exc}): run it from a clone with "
              "`pip install \".[eval]\"`, or `python -m eval.drift` there.", file=sys.stderr)
        return 2
    try:
        return eval_main(argv, prog="hf-pagedkv eval")
    except ImportError as exc:  # a missing extra, say the `demo` extra for the default model: one line, no traceback
        print(f"hf-pagedkv eval: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hf-pagedkv eval: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # all of its flags go to eval.drift's own parser
        return _eval(argv[1:])
    parser = argparse.ArgumentParser(prog="hf-pagedkv", description="Paged, refcounted KV cache for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("eval", add_help=False, help="drift of cache configs vs DynamicCache on a dataset "
                                                "(hf-pagedkv eval --help)")
    g = sub.add_parser("generate", help="generate through a PagedCache and report the memory it held")
    g.add_argument("--model", default=DEFAULT_MODEL, help="transformers id, local path or .gguf (default: %(default)s)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a chat message to answer (default: summarise a ~2,300-token document Python "
                     "ships)")
    src.add_argument("--file", help="summarise this text file")
    g.add_argument("--no-chat", dest="chat", action="store_false", help="send --prompt as raw text, no chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: PagedCache's, 16, or 32 with --quant)")
    g.add_argument("--quant", default="fp", type=quant_name, metavar="FORMAT",
                   help=f"KV storage format, e.g. k8v4: 8-bit keys, 4-bit values; {QUANT_HELP} (default: %(default)s)")
    g.add_argument("--retention", metavar="SPEC", help="a retention policy that evicts tokens and frees their blocks: "
                   "sink_window:SINK:WINDOW, or NAME:BUDGET|RATIO[:SHARE] with NAME one of key_norm, key_diff, "
                   "snapkv, pyramidkv, kv_zip, kv_zip_global, kv_zip_weighted (the query-aware ones switch the "
                   "model to the hf_pagedkv attention)")
    g.add_argument("--attention", choices=["sdpa", "hf_pagedkv", "hf_pagedkv_compiled"], default=None,
                   help="the model's attention: sdpa, hf_pagedkv (reads the cache's blocks and codes in place) or "
                   "hf_pagedkv_compiled (its quantized reads in C on the CPU, Triton on CUDA) (default: sdpa, or "
                   "hf_pagedkv for the query-aware and reconstruction policies, which need one of the last two)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, help="sampling temperature, with --do-sample (default: the model's)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass, with --do-sample (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="random seed, set before each generation (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=0,
                   help="torch CPU threads, 0 for torch's default (1 is faster on a busy machine) (default: 0)")
    g.add_argument("--check", action="store_true", help="also run DynamicCache and compare the outputs (with "
                   "--quant, differences are reported, not an error)")
    g.add_argument("-v", "--verbose", action="store_true")
    add_tool_commands(sub)  # plan, tune-block-size, trace
    add_serve_command(sub)
    args = parser.parse_args(argv)
    if args.command != "generate":
        return run_tool(args, sub.choices[args.command])  # its errors show its own usage line
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.max_new_tokens <= 0:
        g.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.block_size is not None and args.block_size <= 0:
        g.error(f"--block-size must be positive, got {args.block_size}")
    for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if value is not None and not args.do_sample:
            g.error(f"{flag} applies to sampling: add --do-sample")
    if args.temperature is not None and args.temperature <= 0:
        g.error(f"--temperature must be positive, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        g.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.num_threads < 0:
        g.error(f"--num-threads must be >= 0 (0: torch's default), got {args.num_threads}")
    if not 0 <= args.seed < 2**32:  # what numpy's seeding (transformers' set_seed) accepts
        g.error(f"--seed must be in [0, 2**32), got {args.seed}")
    # the prompt, the model's path, the storage format and the policy, checked before the model loads (it takes a
    # while), the cheap checks first: the first three import neither torch nor transformers
    for refusal in (_prompt_error(args), missing_model_path(args.model)):
        if refusal is not None:
            print(f"hf-pagedkv generate: {refusal}", file=sys.stderr)
            return 2
    check_pool_flags(g, "--quant/--block-size", block_size=args.block_size, quant=args.quant)
    args.retention_policy = None
    if args.retention is not None:
        args.retention_policy = parse_retention_flag(args.retention, g.error)
    policy = args.retention_policy
    needs_queries = policy is not None and (policy.needs_queries or policy.reconstructs)
    if args.attention is None:
        args.attention = "hf_pagedkv" if needs_queries else "sdpa"
    elif needs_queries and args.attention == "sdpa":
        g.error(f"--retention {args.retention} scores tokens with the queries, which sdpa does not hand to the "
                     "cache: use --attention hf_pagedkv (or hf_pagedkv_compiled), or leave --attention out")
    try:
        return _generate(args)
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, and no traceback
        print("hf-pagedkv generate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
