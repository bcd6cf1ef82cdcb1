"""Tensor-parallel continuous batching: the script each rank runs, and the scenario it shares with the test.

Run under torchrun, one process per rank (CPU and gloo, or CUDA and nccl)::

    torchrun --standalone --nproc_per_node 2 tests/integration/tp_engine.py MODEL_DIR OUT_DIR

Each rank loads MODEL_DIR with `tp_plan="auto"` (so it holds `num_key_value_heads / world_size` KV heads), runs
`run_engine` and writes ``OUT_DIR/rank{r}.pt``: every request's tokens, every step's scheduling decision (which
requests computed which tokens, which were preempted), the engine's counters, its pool's block event log and final
stats. `tests/integration/test_tensor_parallel_engine.py` launches it and compares the ranks with each other and
with one process running the same `run_engine`. Each rank runs with its own ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

import torch

BLOCK_SIZE = 4
POOL_BLOCKS = 9  # the fixed pool of the `Engine` run: small enough that requests are preempted
MAX_BATCH_TOKENS = 12  # tokens per step: prompts longer than this are prefilled in chunks
MAX_NEW = 6
EOS = 2  # the tiny models' eos
PROMPT_LENGTHS = (1, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17)  # around block boundaries (multiples of BLOCK_SIZE)
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.95}
SEED = 1234  # the seeded sampled request's generator
GLOBAL_SEED = 99  # torch.manual_seed on every rank before the unseeded sampled request draws its seed
MAX_MEMORY = 21_504  # bytes for the `generate_batch` run's pool: 14 blocks of this rank's 1536 bytes (2 KV heads
# in one process: 3072 bytes, 7 blocks)


def prompts(vocab: int) -> list[list[int]]:
    """One prompt per length of `PROMPT_LENGTHS`, random ids in ``[3, vocab)`` (no special ids), fixed."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@contextlib.contextmanager
def recorded_steps():
    """Record every `Scheduler.schedule` decision (all engines) while the block runs.

    Yields:
        `list[dict]`: one record per step: ``chunks`` [(request id, start, tokens)] in packed order, ``preempted``
        and ``rejected`` request ids.
    """
    from hf_pagedkv.serving.scheduler import Scheduler

    steps: list[dict] = []
    schedule = Scheduler.schedule

    def recording(self):
        batch = schedule(self)
        steps.append({"chunks": [(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks],
                      "preempted": [r.request_id for r in batch.preempted],
                      "rejected": [r.request_id for r in batch.rejected]})
        return batch

    Scheduler.schedule = recording
    try:
        yield steps
    finally:
        Scheduler.schedule = schedule


def _events(pool) -> list[dict]:
    """The pool's block event log without wall-clock times (the only field allowed to differ between ranks)."""
    return [{k: v for k, v in e.items() if k != "t"} for e in pool.events.events()]


def _pool_result(pool) -> dict:
    pool.check_invariants()
    s = pool.stats()
    return {"kv_heads": [spec.num_kv_heads for spec in pool.groups[0].store.specs.values()], "num_blocks": s.num_blocks,
            "blocks_in_use": s.blocks_in_use, "blocks_free": s.blocks_free,
            "num_sequences": s.num_sequences, "bytes_in_use": s.bytes_in_use, "bytes_per_block": s.bytes_per_block,
            "events": _events(pool)}


def run_engine(model) -> dict:
    """The scenario: greedy requests of every `PROMPT_LENGTHS` length, a seeded and an unseeded sampled one,
    through `Engine` stepped here on a fixed `POOL_BLOCKS` pool; the greedy prompts again through
    `generate_batch` on a `max_memory` pool.

    Returns:
        `dict`: ``engine``: ``tokens`` {request id: generated ids}, ``finish`` {request id: finish reason},
        ``steps`` (`recorded_steps`), ``stats`` (engine counters), ``pool`` (final pool stats and its event log);
        ``batch``: ``tokens`` (in prompt order), ``steps``, ``pool``.
    """
    from transformers import GenerationConfig

    from hf_pagedkv import BlockPool
    from hf_pagedkv.serving import Engine, generate_batch

    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS)
    ps = prompts(model.config.vocab_size)
    pool = BlockPool(block_size=BLOCK_SIZE, num_blocks=POOL_BLOCKS, debug=True)
    pool.events.enable()
    engine = Engine(model, pool, generation_config=config, max_batch_tokens=MAX_BATCH_TOKENS)
    with torch.inference_mode(), recorded_steps() as steps:
        ids = [engine.add_request(p, f"greedy_{len(p)}") for p in ps]
        ids.append(engine.add_request(ps[5], "sampled", **SAMPLED, seed=SEED))
        torch.manual_seed(GLOBAL_SEED)  # the unseeded request draws its seed from torch's global generator
        ids.append(engine.add_request(ps[6], "unseeded", **SAMPLED))
        while engine.has_unfinished:
            engine.step()
            pool.check_invariants()
        outs = {rid: engine.pop_output(rid) for rid in ids}
    s = engine.stats()
    engine_result = {"tokens": {rid: o.generated_tokens for rid, o in outs.items()},
                     "finish": {rid: o.finish_reason for rid, o in outs.items()}, "steps": steps,
                     "stats": {"num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
                               "num_allocation_failures": s.num_allocation_failures,
                               "num_tokens_computed": s.num_tokens_computed, "num_finished": s.num_finished,
                               "kv_bytes_peak": s.kv_bytes_peak},
                     "pool": _pool_result(pool)}

    pool = BlockPool(block_size=BLOCK_SIZE, max_memory=MAX_MEMORY, debug=True)
    pool.events.enable()
    with torch.inference_mode(), recorded_steps() as steps:
        outs = generate_batch(model, ps, config, pool=pool, max_batch_tokens=MAX_BATCH_TOKENS, progress_bar=False)
    batch_result = {"tokens": [o.generated_tokens for o in outs.values()],
                    "errors": [o.error for o in outs.values()], "steps": steps, "pool": _pool_result(pool)}
    return {"engine": engine_result, "batch": batch_result}


def start_warnings(model) -> list[str]:
    """The warnings `Engine.start()` logs (the background loop is not rank-consistent under tensor parallel)."""
    from hf_pagedkv.serving import Engine

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("hf_pagedkv.serving.engine")
    log.addHandler(handler)
    try:
        Engine(model).start().stop()
    finally:
        log.removeHandler(handler)
    return records


def _rank_main(model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `tp_plan=` is moving into `distributed_config` (5.23)
        model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    model.eval()
    result = run_engine(model)
    result["start_warnings"] = start_warnings(model)
    from tests.integration.tp_launch import save_rank_result

    save_rank_result(result, out_dir)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.integration.tp_launch import reexec_with_rank_hash_seed

    reexec_with_rank_hash_seed()
    _rank_main(sys.argv[1], sys.argv[2])
