"""The runner steps the engine under `torch.inference_mode()`: every step runs in it, and the tensors a step makes
(a growing pool's segments, host-tier copies of swapped requests) are written only in it, by steps, by a client's
cancel from the event loop and by shutdown, so that preemption with swapping, a disconnect and a close all work on a
debug pool (freed blocks poisoned) and answer with solo `generate`'s tokens."""

import asyncio

import torch

from hf_pagedkv import BlockPool
from tests.serving.server_helpers import (BLOCK, MODEL, PROMPTS, model_and_tokenizer, openai, running_server, solo,
                                          tiny_single_thread)  # noqa: F401

NEW = 12


def test_steps_run_in_inference_mode_and_swapping_cancelling_and_closing_work_in_it():
    _, tokenizer = model_and_tokenizer()
    refs = {p: solo(tokenizer(p).input_ids, NEW) for p in PROMPTS}
    # 10 blocks of 4 tokens: the four prompts with 12 new tokens each need 4-6 blocks apiece, so requests are
    # preempted, swapped to the host tier and back
    pool = BlockPool(block_size=BLOCK, num_blocks=10, host_memory="1MiB", prefix_caching=True, debug=True)
    modes = []
    with running_server(pool) as srv:
        engine = srv.service.engine
        step = engine.step

        def recorded_step():
            modes.append(torch.is_inference_mode_enabled())
            return step()

        engine.step = recorded_step

        async def run():
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

            async def one(prompt):
                r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                                    extra_body={"return_token_ids": True, "ignore_eos": True})
                return r.choices[0].token_ids

            async def dropped():  # a stream the client closes after two chunks: cancelled from the event loop
                stream = await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=29,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                got = 0
                async for _ in stream:
                    got += 1
                    if got == 2:
                        break
                await stream.close()

            return await asyncio.gather(*(one(p) for p in PROMPTS * 2), dropped())

        answers = asyncio.run(run())[:-1]
        srv.wait_idle()
        stats = engine.stats()
        assert answers == [refs[p] for p in PROMPTS * 2]
        assert stats.num_swaps > 0 and stats.num_cancelled == 1
    assert modes and all(modes)  # every step ran in inference mode
    assert pool.stats().blocks_in_use == 0
    pool.check_invariants()
