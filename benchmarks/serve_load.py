"""Two OpenAI-compatible servers under the same open-loop load: `hf-pagedkv serve` and `transformers serve
--continuous-batching`.

    python benchmarks/serve_load.py                                  # 48 requests at 1 req/s to each server
    python benchmarks/serve_load.py --requests 8 --rate 2 --max-tokens 8 --targets hf_pagedkv    # a smoke run

Both serve the same weights: the bundled SmolLM2-135M-Instruct GGUF, de-quantized to fp32 and saved once as a
safetensors directory (`transformers serve` needs a config naming its architecture, which the GGUF's lacks), on the
CPU with `--threads` torch threads. Each server is started as a process of its own, warmed up with one request, then
sent the same schedule: `--requests` chat requests whose arrival times are a seeded Poisson process of `--rate`
requests per second (open loop: a request is sent at its time whatever the others are doing), each a shared system
prompt plus a question about a slice of a real document (`textwrap.py`'s source, 40-400 characters), greedy,
`--max-tokens` new tokens at most, streamed (`stream_options.include_usage`).

Per server: requests answered and failed (errors by kind), wall time from the first arrival to the last answer,
output tokens per second over it, TTFT (arrival to the first content chunk) and end-to-end latency P50/P99
(nearest rank), and the CPU seconds the server's processes (all of their threads: `transformers serve` runs its model
in a child process) used from the first arrival to the last answer, read from /proc (Linux; nan elsewhere). The
table is printed, and written as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SYSTEM = "You are a helpful assistant who explains Python code to a new programmer in plain words."


def export_model(folder: str) -> str:
    """The bundled SmolLM2 GGUF, de-quantized to fp32, as a safetensors directory (made once)."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from hf_pagedkv.tools.models import load_model

    model, tokenizer = load_model()
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def workload(n: int, rate: float, seed: int) -> list[tuple[float, list[dict]]]:
    """(arrival seconds, messages) of each request: Poisson arrivals, a question about a slice of a document."""
    from hf_pagedkv.tools.models import default_document

    _, text = default_document()
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        size = rng.randint(40, 400)
        start = rng.randint(0, len(text) - size)
        question = f"What does this code do?\n\n{text[start: start + size]}"
        out.append((t, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]))
        t += rng.expovariate(rate)
    return out


def start(target: str, model_dir: str, port: int, threads: int, args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    if target == "hf_pagedkv":
        cmd = [sys.executable, "-m", "hf_pagedkv.tools.cli", "serve", "--model", model_dir, "--served-model-name",
               model_dir, "--port", str(port), "--num-threads", str(threads),
               "--max-batch-tokens", str(args.max_batch_tokens)]
        if args.max_memory:
            cmd += ["--max-memory", args.max_memory]
    else:
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        cmd = [exe, "serve", "--continuous-batching", "--port", str(port), "--device", "cpu", "--dtype", "float32",
               "--cb-max-batch-tokens", str(args.max_batch_tokens), model_dir]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


async def wait_ready(client, model: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, temperature=0)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


async def one(client, model: str, messages, max_tokens: int, t0: float, arrival: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    sent = time.perf_counter()
    first, tokens, chunks = None, None, 0
    try:
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # counted by kind
        return {"error": type(e).__name__ + (f" {e.status_code}" if hasattr(e, "status_code") else "")}
    end = time.perf_counter()
    return {"ttft": (first or end) - sent, "e2e": end - sent, "tokens": tokens if tokens is not None else chunks,
            "end": end}


def cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of process group `pgid` have used so far; nan without /proc."""
    if not os.path.isdir("/proc"):
        return float("nan")
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # fields from the state on: state ppid pgrp ... utime (11) stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.5) - 1))] if xs else float("nan")


async def drive(target: str, model_dir: str, args) -> dict:
    import openai

    port = args.port + (0 if target == "hf_pagedkv" else 1)
    proc = start(target, model_dir, port, args.threads, args)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                timeout=600)
    try:
        await wait_ready(client, model_dir, proc)
        jobs = workload(args.requests, args.rate, args.seed)
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        results = await asyncio.gather(*(one(client, model_dir, m, args.max_tokens, t0, a) for a, m in jobs))
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        await client.close()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    ok = [r for r in results if "error" not in r]
    errors: dict[str, int] = {}
    for r in results:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    wall = max(r["end"] for r in ok) - t0 if ok else float("nan")
    tokens = sum(r["tokens"] for r in ok)
    return {"target": target, "ok": len(ok), "errors": errors, "wall_s": wall, "tokens": tokens,
            "tok_per_s": tokens / wall if ok else 0.0, "cpu_s": cpu, "req_per_s": len(ok) / wall if ok else 0.0,
            "ttft_p50": pct([r["ttft"] for r in ok], 0.5), "ttft_p99": pct([r["ttft"] for r in ok], 0.99),
            "e2e_p50": pct([r["e2e"] for r in ok], 0.5), "e2e_p99": pct([r["e2e"] for r in ok], 0.99)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="hf_pagedkv,transformers", help="comma-separated: hf_pagedkv, transformers")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512, help="both servers' tokens per step")
    p.add_argument("--max-memory", default=None, help="hf-pagedkv serve --max-memory (default: a growable pool)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8790, help="hf-pagedkv serve's port; transformers serve's is +1")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "hf_pagedkv_smollm2_fp32"),
                   help="where the exported model is kept (made once)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not set(targets) <= {"hf_pagedkv", "transformers"}:
        p.error(f"--targets: hf_pagedkv and/or transformers, got {args.targets!r}")
    model_dir = export_model(args.model_dir)
    import transformers

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}, "
          f"transformers {transformers.__version__}; {args.requests} requests, Poisson {args.rate}/s, "
          f"max_tokens {args.max_tokens}, max_batch_tokens {args.max_batch_tokens}, seed {args.seed}")
    rows = [asyncio.run(drive(t, model_dir, args)) for t in targets]
    head = "| server | ok | errors | wall s | output tok/s | req/s | TTFT P50 | TTFT P99 | E2E P50 | E2E P99 | CPU s |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for r in rows:
        errs = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
        print(f"| {r['target']} | {r['ok']} | {errs} | {r['wall_s']:.1f} | {r['tok_per_s']:.1f} | "
              f"{r['req_per_s']:.2f} | {r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s | {r['e2e_p50']:.2f} s | "
              f"{r['e2e_p99']:.2f} s | {r['cpu_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] == args.requests for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
