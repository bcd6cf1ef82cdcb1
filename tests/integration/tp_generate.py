"""Tensor-parallel generation with PagedCache: the script each rank runs, and the scenarios it shares with the test.

Run under torchrun, one process per rank (CPU and the gloo backend work, as do CUDA and nccl)::

    torchrun --standalone --nproc_per_node 2 tests/integration/tp_generate.py MODEL_DIR OUT_DIR

MODEL_DIR is a model saved with `save_pretrained` whose `num_key_value_heads` the world size divides. Each rank
loads it with `tp_plan="auto"` (so it holds `num_key_value_heads / world_size` KV heads), runs `run_scenarios` with
PagedCache, and writes ``OUT_DIR/rank{r}.pt``: the outputs, what its pool measured (KV heads per layer, blocks,
bytes per block) and its block event log. `tests/integration/test_tensor_parallel.py` launches it and compares the
ranks with each other and with a single-process `DynamicCache` run of the same `run_scenarios`.

Each rank re-executes itself once with its own ``PYTHONHASHSEED``, so that Python's string hashing differs between
ranks: if any allocation decision depended on it, the ranks' event logs would differ.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

BLOCK_SIZE = 4
MAX_NEW = 10
MAX_MEMORY = 100_000  # bytes for the max_memory scenario's pool (all layers, this rank's KV heads)
PREFIX_POOL_BLOCKS = 12  # small enough that the prefix scenario evicts cached-idle blocks
PROMPTS = [[1, 5, 9, 33, 17, 4, 8, 21, 9, 10, 44], [1, 7, 3, 60, 12]]  # left-padded into one batch
PREFIX = [1, 5, 9, 33, 17, 4, 8, 21, 9]  # shared by the prefix scenario's requests
PREFIX_REQUESTS = [PREFIX + [10, 44], PREFIX + [70, 71, 72], [1, 90, 91, 92, 93, 94, 95, 3, 4], PREFIX + [10, 44]]
GEN = {"do_sample": False, "max_new_tokens": MAX_NEW, "return_dict_in_generate": True, "output_logits": True}


def padded_batch(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` `[len(prompts), max_len]`, left-padded with `pad`."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run_scenarios(model, make_cache) -> dict:
    """The generations compared between ranks and against the reference, with caches from `make_cache(name)`.

    Returns:
        `dict`: ``greedy_sequences`` `[2, width + MAX_NEW]` and ``greedy_logits`` `[MAX_NEW, 2, vocab]` (fp32) of a
        left-padded batch; ``beam_sequences`` `[2, len + MAX_NEW]` of beam search (3 beams, 2 returned).
    """
    ids, mask = padded_batch(PROMPTS)
    with torch.inference_mode():
        greedy = model.generate(ids, attention_mask=mask, past_key_values=make_cache("greedy"), **GEN)
        beams = model.generate(ids[:1], past_key_values=make_cache("beams"), do_sample=False, max_new_tokens=MAX_NEW,
                               num_beams=3, num_return_sequences=2)
    return {"greedy_sequences": greedy.sequences, "greedy_logits": torch.stack(greedy.logits),
            "beam_sequences": beams}


def _events(pool) -> list[dict]:
    """The pool's block event log without wall-clock times (the only field allowed to differ between ranks)."""
    return [{k: v for k, v in e.items() if k != "t"} for e in pool.events.events()]


def _rank_main(model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    import hf_pagedkv
    from hf_pagedkv import BlockPool, PagedCache

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        # NOTE: transformers 5.23 warns that `tp_plan=` moves into `distributed_config=DistributedConfig(tp_plan=...)`;
        # both build the same DistributedConfig. This is the spelling the transformers TP docs show users.
        warnings.simplefilter("ignore", FutureWarning)
        model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    model.eval()
    caches: dict[str, PagedCache] = {}

    def make_cache(name: str) -> PagedCache:
        kwargs = {"max_memory": MAX_MEMORY} if name == "greedy" else {}
        cache = PagedCache(block_size=BLOCK_SIZE, config=model.config, debug=True, **kwargs)
        cache.pool.events.enable()
        caches[name] = cache
        return cache

    result = run_scenarios(model, make_cache)
    # On this rank, PagedCache must equal DynamicCache bit for bit: the same shards, the same forward steps.
    from transformers import DynamicCache

    dynamic = run_scenarios(model, lambda name: DynamicCache(config=model.config))
    result["dynamic_equal"] = {k: torch.equal(result[k], dynamic[k]) for k in result}
    for name, cache in caches.items():
        pool = cache.pool
        spec = pool.groups[0].store.specs[0]
        result[name] = {"kv_heads": [s.num_kv_heads for s in pool.groups[0].store.specs.values()],
                        "head_dim": spec.key_dim, "num_layers": len(pool.groups[0].store.specs),
                        "num_blocks": pool.num_blocks, "bytes_per_block": pool.stats().bytes_per_block,
                        "tables": cache.block_tables()}
        with torch.inference_mode():  # debug=True poisons the freed blocks: inference tensors, written in this mode
            cache.release()
        pool.check_invariants()
        result[name]["events"] = _events(pool)  # the whole life of the cache, its release included

    # Prefix caching on a fixed, small pool: hits, copy-on-write of published blocks and LRU eviction, all of
    # which must decide the same blocks on every rank.
    pool = BlockPool(block_size=BLOCK_SIZE, num_blocks=PREFIX_POOL_BLOCKS, prefix_caching=True, debug=True)
    pool.events.enable()
    with torch.inference_mode():
        outs = [hf_pagedkv.generate(model, torch.tensor([r]), pool=pool, do_sample=False, max_new_tokens=MAX_NEW)
                for r in PREFIX_REQUESTS]
    pool.check_invariants()
    stats = pool.stats()
    result["prefix"] = {"sequences": [o[0].tolist() for o in outs], "events": _events(pool),
                        "hit_tokens": stats.hit_tokens, "evictions": stats.evictions}

    from tests.integration.tp_launch import save_rank_result

    save_rank_result(result, out_dir)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.integration.tp_launch import reexec_with_rank_hash_seed

    reexec_with_rank_hash_seed()
    _rank_main(sys.argv[1], sys.argv[2])
