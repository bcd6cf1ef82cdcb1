"""What the HTTP server adds to the engine's work: the same chat requests through the `Engine` alone and through
`hf-pagedkv serve`'s application, in one process, SmolLM2 (fp32, one torch thread).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/serve_overhead.py --requests 24 --max-tokens 32 --rounds 2

`--requests` chat requests of `benchmarks/serve_load.py`'s workload (a shared system prompt and a question about a
slice of `textwrap.py`), all sent at once (past capacity: the engine always has work), greedy, `--max-tokens` each
(``ignore_eos``). Each round runs the engine alone (stepped in this thread) under `torch.no_grad()` and under
`torch.inference_mode()` (as the server's runner steps it; the tokens must be the same), and then the server
(uvicorn in a thread, its engine thread, an `openai` streaming client in this thread). Prints per round wall time and CPU seconds per
thread: the engine's (stepping: forwards, scheduling, sampling) and the server's other threads' together (the event
loop: HTTP, detokenizing, server-sent events; its worker threads: parsing, chat templates, prompt tokenizing). On a shared machine wall time moves with the load (printed); CPU
seconds move much less.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import openai  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402

from benchmarks.serve_load import workload  # noqa: E402
from hf_pagedkv import BlockPool  # noqa: E402
from hf_pagedkv.serving import Engine  # noqa: E402
from hf_pagedkv.serving.server import EngineService, create_app  # noqa: E402
from hf_pagedkv.serving.server.http_server import DrainingServer, bind  # noqa: E402
from hf_pagedkv.tools.models import load_model  # noqa: E402


def threads_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by native thread id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def engine_alone(model, prompts: list[list[int]], max_tokens: int, mode) -> dict:
    engine = Engine(model, BlockPool(prefix_caching=True))
    with mode():
        wall, cpu = time.perf_counter(), time.thread_time()
        rids = [engine.add_request(p, max_new_tokens=max_tokens, eos_token_id=[]) for p in prompts]
        while engine.has_unfinished:
            engine.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        outputs = [engine.output(r).generated_tokens for r in rids]
        engine.close()
    return {"wall_s": wall, "tokens": sum(map(len, outputs)), "engine_cpu_s": cpu, "outputs": outputs}


def served(model, tokenizer, conversations, max_tokens: int) -> dict:
    service = EngineService(Engine(model, BlockPool(prefix_caching=True)), tokenizer, "m")
    sock = bind("127.0.0.1", 0)
    server = DrainingServer(uvicorn.Config(create_app(service), log_level="warning"), service)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)

        async def one(messages) -> int:
            stream = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            return [chunk.usage.completion_tokens async for chunk in stream if chunk.usage][-1]

        return await asyncio.gather(*(one(m) for m in conversations))

    engine_id, client_id = service.runner._thread.native_id, threading.get_native_id()
    before, wall = threads_cpu(), time.perf_counter()
    tokens = sum(asyncio.run(run()))
    used = {tid: cpu - before.get(tid, 0.0) for tid, cpu in threads_cpu().items()}  # threads started meanwhile: all
    result = {"wall_s": time.perf_counter() - wall, "tokens": tokens, "engine_cpu_s": used[engine_id],
              "server_cpu_s": sum(cpu for tid, cpu in used.items() if tid not in (engine_id, client_id))}
    server.should_exit = True
    thread.join(30)
    sock.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    conversations = [messages for _, messages in workload(args.requests, 1.0, 0)]
    prompts = [tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids for m in conversations]
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; {args.requests} requests x "
          f"{args.max_tokens} tokens")
    for r in range(args.rounds):
        grad = engine_alone(model, prompts, args.max_tokens, torch.no_grad)
        inference = engine_alone(model, prompts, args.max_tokens, torch.inference_mode)
        assert grad.pop("outputs") == inference.pop("outputs"), "inference_mode changed the tokens"
        for name, result in (("engine alone, no_grad", grad), ("engine alone, inference_mode", inference),
                             ("served", served(model, tokenizer, conversations, args.max_tokens))):
            extra = (f", server threads CPU {result['server_cpu_s']:.2f} s"
                     if "server_cpu_s" in result else "")
            print(f"round {r}, {name}: {result['tokens']} tokens in {result['wall_s']:.1f} s "
                  f"({result['tokens'] / result['wall_s']:.1f} tok/s), engine CPU {result['engine_cpu_s']:.2f} s"
                  f"{extra}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
