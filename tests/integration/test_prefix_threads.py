"""One prefix-caching pool shared by 4 threads, each generating with its own caches."""

import threading
import time

import torch

import hf_pagedkv
from hf_pagedkv import BlockPool
from tests.conftest import ids, tiny_model
from tests.prefix_utils import (
    GEN,
    assert_same_output,
    fresh_generate,
    tiny_single_thread,  # noqa: F401 (autouse fixture)
)

B = 4
THREADS, PER_THREAD = 4, 20


def make_requests() -> list[torch.Tensor]:
    """80 prompts over 3 documents: shared prefixes of 1 to 3 blocks (and ragged ones), short unique suffixes."""
    docs = [ids(1, 3 * B + 2, seed=200 + d) for d in range(3)]
    out = []
    for k in range(THREADS * PER_THREAD):
        shared = docs[k % 3][:, : (k % 4) * B + (k % 3)]
        out.append(torch.cat([shared, ids(1, 1 + k % 5, seed=300 + k)], 1))
    return out


def test_four_threads_one_pool_match_the_sequential_run():
    model = tiny_model("llama")
    requests = make_requests()
    sequential_pool = BlockPool(block_size=B, prefix_caching=True)
    sequential = [hf_pagedkv.generate(model, x, pool=sequential_pool, **GEN) for x in requests]
    for k in (0, 7, 42):  # the sequential run itself equals fresh runs (more in test_prefix_caching.py)
        assert_same_output(fresh_generate(model, requests[k]), sequential[k])

    pool = BlockPool(block_size=B, num_blocks=48, prefix_caching=True, debug=True)  # small: evicts under load
    outputs: dict[int, object] = {}
    errors: list[BaseException] = []
    running = threading.Event()
    running.set()

    def worker(t: int) -> None:
        try:
            for k in range(t, len(requests), THREADS):
                outputs[k] = hf_pagedkv.generate(model, requests[k], pool=pool, **GEN)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def checker() -> None:  # invariants must hold at every moment another thread can observe
        try:
            while running.is_set():
                pool.check_invariants()
                time.sleep(0.001)  # leave the GIL to the workers most of the time
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    check = threading.Thread(target=checker)
    check.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    running.clear()
    check.join()
    assert errors == []
    assert sorted(outputs) == list(range(len(requests)))
    for k, x in enumerate(requests):
        assert_same_output(sequential[k], outputs[k])
    pool.check_invariants()
    s = pool.stats()
    assert s.blocks_in_use == 0 and s.num_sequences == 0
    assert s.lookups == len(requests) and s.hit_tokens > 0 and s.evictions > 0, s
