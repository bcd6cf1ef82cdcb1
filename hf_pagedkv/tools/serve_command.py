"""``hf-pagedkv serve``: the OpenAI-compatible HTTP server (`hf_pagedkv.serving.server`) on a model.

Everything a flag names is checked before the model loads (storage format, sizes, the port, the prefix-cache
file's folder, a local model path that is not there), the checks that need no import before the server's packages
and torch are imported; the port is bound before loading too, so a taken port fails at once. What needs the model's
shape (a --max-memory below one block) is checked right after it loads, before the server starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from hf_pagedkv.config import parse_bytes
from hf_pagedkv.errors import counted, install_hint
from hf_pagedkv.tools.cli_tools import QUANT_HELP, check_pool_flags, parse_retention_flag, quant_name
from hf_pagedkv.tools.models import DEFAULT_MODEL, missing_model_path


_INSTALL = install_hint("serve", "fastapi uvicorn prometheus_client")


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the `hf-pagedkv` subcommands."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching on a BlockPool)")
    s.add_argument("--model", default=DEFAULT_MODEL, help="transformers id, local path or .gguf (default: %(default)s)")
    s.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model as given)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port, 0 for a free one (default: %(default)s)")
    s.add_argument("--quant", default="fp", type=quant_name, metavar="FORMAT",
                   help=f"KV storage format, e.g. k8v4: 8-bit keys, 4-bit values; {QUANT_HELP} (default: %(default)s)")
    s.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 16, or 32 with --quant)")
    s.add_argument("--max-memory", help="a fixed KV budget, e.g. 2GiB: requests beyond it wait, or are preempted "
                                        "and recomputed (default: a pool that grows on demand)")
    s.add_argument("--host-memory", help="a host-memory tier, e.g. 8GiB: preempted requests are swapped there "
                                         "instead of recomputed, and prefix blocks evicted from the device kept")
    s.add_argument("--prefix-cache-file", help="a prefix-cache file (safetensors): loaded at start if it exists, "
                                               "saved atomically at shutdown")
    s.add_argument("--retention", metavar="SPEC", help="every request's retention policy, e.g. sink_window:4:1024 "
                                                       "(evicts tokens and frees their blocks; docs/serving_http.md)")
    s.add_argument("--max-batch-tokens", type=int, default=None,
                   help="tokens computed per engine step: decode tokens plus prefill chunks (default: 512)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for the engine at most; past it new requests get 429 with Retry-After "
                        "(default: %(default)s)")
    s.add_argument("--max-body-bytes", default="4MiB",
                   help="the largest request body accepted, e.g. 16MiB; larger ones get 413 before they are parsed "
                        "(default: %(default)s)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and KV dtype (default: %(default)s)")
    s.add_argument("--device", default=None, help="device of the model and the pool, e.g. cuda:0 (default: where "
                                                  "from_pretrained puts it, the CPU)")
    s.add_argument("--num-threads", type=int, default=0, help="torch CPU threads, 0 for torch's default")
    s.add_argument("-v", "--verbose", action="store_true", help="log requests and engine events")
    s.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the flags, bind the port, load the model, serve until SIGTERM (then drain and save)."""
    for flag, value, low in (("--port", args.port, 0), ("--max-queue", args.max_queue, 1),
                             ("--num-threads", args.num_threads, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        parser.error(f"--port must be <= 65535, got {args.port}")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        parser.error(f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}")
    for flag, value in (("--max-memory", args.max_memory), ("--host-memory", args.host_memory),
                        ("--max-body-bytes", args.max_body_bytes)):
        if value is not None:
            try:
                parse_bytes(value, flag)
            except ValueError as e:
                parser.error(f"{flag}: {e}")
    if args.prefix_cache_file is not None:
        folder = os.path.dirname(os.path.abspath(args.prefix_cache_file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--prefix-cache-file {args.prefix_cache_file!r}: its folder {folder!r} is not a writable "
                         "directory (the file is saved there at shutdown)")
    missing = missing_model_path(args.model)
    if missing is not None:
        print(f"hf-pagedkv serve: {missing}", file=sys.stderr)
        return 2
    pool_kwargs = dict(block_size=args.block_size, quant=args.quant, max_memory=args.max_memory,
                       host_memory=args.host_memory, prefix_caching=True)
    # the pool's settings (the codecs' packing rules import torch, a second; its storage waits for the model)
    check_pool_flags(parser, "--quant/--block-size/--max-memory/--host-memory", **pool_kwargs)
    retention = _retention_policy(args, parser)
    # the flags above need no import but torch; the rest needs the server's packages (seconds to import)
    import torch

    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            parser.error(f"--device {args.device}: {e}")
        usable = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= usable:
            parser.error(f"--device {args.device}: this machine has {usable} usable CUDA devices; pick one of them, "
                         "or leave --device out")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"hf-pagedkv serve needs fastapi and uvicorn ({e}); install them: {_INSTALL}.", file=sys.stderr)
        return 2

    from hf_pagedkv.errors import PoolExhaustedError
    from hf_pagedkv.pool.block_pool import BlockPool
    from hf_pagedkv.serving import Engine
    from hf_pagedkv.serving.server import EngineService, create_app
    from hf_pagedkv.serving.server.http_server import bind, serve
    from hf_pagedkv.tools.models import load_model

    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"hf-pagedkv serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except (ValueError, ImportError) as e:  # ImportError: a GGUF model without the `demo` extra
        sock.close()
        print(f"hf-pagedkv serve: --model: {e}", file=sys.stderr)
        return 2
    pool = BlockPool(**pool_kwargs)
    if args.prefix_cache_file is not None and os.path.exists(args.prefix_cache_file):
        try:
            pool.load_prefix_cache(args.prefix_cache_file, model=model)
        except (ValueError, OSError) as e:
            sock.close()
            flag = "--max-memory" if "less than one block" in str(e) else "--prefix-cache-file"  # (it sizes the pool)
            print(f"hf-pagedkv serve: {flag}: {e}", file=sys.stderr)
            return 2
        except PoolExhaustedError as e:  # a file saved from a bigger pool: it loads all of its blocks or none
            sock.close()
            detail = str(e).split(";")[0].removeprefix(f"load_prefix_cache: {args.prefix_cache_file} ")
            print(f"hf-pagedkv serve: --prefix-cache-file {args.prefix_cache_file}: the file's prefix blocks do not "
                  f"fit the pool (the file {detail}); nothing was loaded. Raise --max-memory, add --host-memory to "
                  "take the rest, or move the file away to start with an empty prefix cache.", file=sys.stderr)
            return 2
        print(f"hf-pagedkv serve: loaded {counted(pool.last_loaded_blocks, 'prefix block')} from "
              f"{args.prefix_cache_file}",
              file=sys.stderr)
    try:  # the engine sizes a --max-memory pool: a budget too small for one block is refused here
        engine = Engine(model, pool, max_batch_tokens=args.max_batch_tokens, retention=retention)
    except ValueError as e:
        sock.close()
        print(f"hf-pagedkv serve: --max-memory: {str(e).removeprefix('Engine: ')}", file=sys.stderr)
        return 2
    service = EngineService(engine, tokenizer, args.served_model_name or args.model, max_queue=args.max_queue,
                            prefix_cache_file=args.prefix_cache_file)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(f"hf-pagedkv serve: {service.model_name} at http://{url_host}:{port}/v1 (SIGTERM or Ctrl+C drains and "
          "stops)", file=sys.stderr, flush=True)
    app = create_app(service, max_body_bytes=parse_bytes(args.max_body_bytes, "--max-body-bytes"))
    serve(app, service, sock, log_level="info" if args.verbose else "warning")
    print("hf-pagedkv serve: stopped", file=sys.stderr)
    return 0


def _retention_policy(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The policy `--retention` names (`parse_retention`, as `hf-pagedkv generate --retention`), or None; a bad spec,
    or a policy the engine cannot run on the model as `load_model` loads it (with `sdpa`), is refused here, before
    the model loads."""
    if args.retention is None:
        return None
    from hf_pagedkv.serving.request_retention import engine_policy_problem

    policy = parse_retention_flag(args.retention, parser.error)
    problem = engine_policy_problem(policy, reads_in_place=False)
    if problem is not None:
        parser.error(f"--retention {args.retention}: {problem}")
    return policy


__all__ = ["add_serve_command", "run_serve"]
