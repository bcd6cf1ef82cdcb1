"""The block event log (hf_pagedkv/observe/events.py) and the trace analysis (hf_pagedkv/observe/trace.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.observe.trace import analyze, read_trace
from tests.conftest import ids, tiny_model


def _kinds(report, block: int) -> list[tuple[str, int | None, int | None]]:
    return [(h.kind, h.before, h.after) for h in report.histories[block]]


def test_disabled_by_default_records_nothing():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    assert not pool.events.enabled
    with PagedCache(pool=pool) as cache:
        model.generate(ids(1, 9), past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert pool.events.events() == [] and pool.events.num_events == 0


def test_fork_and_copy_on_write_story():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    pool.events.enable()
    a = PagedCache(pool=pool)
    with torch.inference_mode():
        model(ids(1, 6), past_key_values=a)  # a: blocks [0, 1], 6 tokens (block 1 half full)
        b = a.fork()  # b shares blocks 0 and 1
        model(ids(1, 1, seed=5), past_key_values=a)  # a writes into shared block 1: copies it to block 2 first
    assert a.block_tables() == [[0, 2]] and b.block_tables() == [[0, 1]]
    a.release()
    b.release()
    pool.check_invariants()
    events = pool.events.events()
    assert [(e["kind"], e["blocks"]) for e in events] == [
        ("state", []),  # enable(): nothing in use yet
        ("allocate", [0, 1]),  # a's prefill
        ("append", [0, 1]),  # ... into row 0 of a, 0 -> 6 tokens
        ("fork", [0, 1]),  # b = a.fork()
        ("allocate", [2]),  # copy-on-write target
        ("free", [1]),  # a lets go of the shared block 1
        ("cow", [2]),  # block 1 copied to 2 for a
        ("free", [0, 2]),  # a.release()
        ("free", [0, 1]),  # b.release()
    ]
    append, cow = events[2], events[6]
    assert (append["seq"], append["row"], append["start"], append["end"]) == (a.seq_id, 0, 0, 6)
    assert (cow["seq"], cow["src"], cow["dst"], cow["start"]) == (a.seq_id, [1], [2], 6)
    assert [e["n"] for e in events] == list(range(len(events)))
    report = analyze(events)
    assert report.ok and report.never_freed == {} and report.double_frees == []
    assert _kinds(report, 1) == [("allocate", 0, 1), ("append", 1, 1), ("fork", 1, 2), ("free", 2, 1),
                                 ("free", 1, 0)]
    assert _kinds(report, 2) == [("allocate", 0, 1), ("cow", 1, 1), ("free", 1, 0)]


def test_double_free_is_recorded_before_the_pool_raises():
    pool = BlockPool(block_size=4, num_blocks=4)
    pool.events.enable()
    blocks = pool._allocate(2)
    pool._free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool._free([blocks[1]])
    report = analyze(pool.events.events())
    assert [(d.block, d.before) for d in report.double_frees] == [(1, 0)]
    assert not report.ok


def test_leak_is_reported_with_its_owner():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    pool.events.enable()
    kept = PagedCache(pool=pool)
    with torch.inference_mode():
        model(ids(1, 5), past_key_values=kept)
    report = analyze(pool.events.events())
    assert report.never_freed == {0: 1, 1: 1}
    assert report.histories[1][-1].record["seq"] == kept.seq_id
    kept.release()
    assert analyze(pool.events.events()).ok


def test_enable_mid_run_starts_from_the_refcounts_in_use():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    a = PagedCache(pool=pool)
    with torch.inference_mode():
        model(ids(1, 8), past_key_values=a)
    b = a.fork()
    pool.events.enable()
    state = pool.events.events()[0]
    assert (state["kind"], state["blocks"], state["refcounts"]) == ("state", [0, 1], [2, 2])
    a.release()
    b.release()
    report = analyze(pool.events.events())
    assert report.ok  # no false double free: the trace knew both blocks started at refcount 2
    assert _kinds(report, 0) == [("state", None, 2), ("free", 2, 1), ("free", 1, 0)]


def test_sampling_keeps_whole_histories_of_sampled_blocks():
    model = tiny_model("llama")
    x = ids(1, 10)
    reports = []
    for rate in (1.0, 0.5):
        pool = BlockPool(block_size=2)
        pool.events.enable(sample_rate=rate)
        with PagedCache(pool=pool) as cache:
            model.generate(x, past_key_values=cache, max_new_tokens=8, num_beams=2, do_sample=False)
        reports.append(analyze(pool.events.events(), pool.events.header()))
    full, sampled = reports
    assert 0 < len(sampled.histories) < len(full.histories)
    for block, history in sampled.histories.items():
        assert [(h.kind, h.before, h.after) for h in history] == _kinds(full, block)
    assert sampled.ok and full.ok


def test_bounded_trace_drops_the_oldest_and_analysis_stays_sound():
    model = tiny_model("llama")
    pool = BlockPool(block_size=2)
    pool.events.enable(capacity=6)
    with PagedCache(pool=pool) as cache:
        model.generate(ids(1, 7), past_key_values=cache, max_new_tokens=6, do_sample=False)
    events = pool.events.events()
    assert len(events) == 6
    assert pool.events.num_dropped == pool.events.num_events - 6 > 0
    assert [e["n"] for e in events] == list(range(pool.events.num_events - 6, pool.events.num_events))
    report = analyze(events, pool.events.header())
    assert report.ok  # blocks first seen mid-history start unknown: never reported as leaks or double frees


def test_events_go_to_the_logger_and_leave_outputs_exact(caplog):
    model = tiny_model("llama")
    x = ids(2, 9)
    ref = model.generate(x, past_key_values=DynamicCache(), max_new_tokens=6, do_sample=False)
    caplog.set_level(logging.DEBUG, logger="hf_pagedkv.observe.events")
    pool = BlockPool(block_size=4)
    pool.events.enable()
    with PagedCache(pool=pool) as cache:
        out = model.generate(x, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(ref, out)
    logged = [r.event for r in caplog.records if r.name == "hf_pagedkv.observe.events" and hasattr(r, "event")]
    assert logged == pool.events.events()


def test_dump_round_trip(tmp_path):
    pool = BlockPool(block_size=4, num_blocks=8)
    pool.events.enable()
    pool._allocate(3)
    path = tmp_path / "trace.jsonl"
    assert pool.events.dump(path) == 2
    header, records = read_trace(path)
    assert header["block_size"] == 4 and header["num_dropped"] == 0
    assert records == pool.events.events()
    assert pool.events.take_events() == records and pool.events.events() == []


def test_bad_settings(monkeypatch, tmp_path):
    pool = BlockPool()
    with pytest.raises(ValueError, match=r"sample_rate.*\(0, 1\], got 0"):
        pool.events.enable(sample_rate=0)
    with pytest.raises(ValueError, match="capacity"):
        pool.events.enable(capacity=0)
    assert not pool.events.enabled
    pool.events.enable()
    with pytest.raises(ValueError, match="Unknown block event kind 'alloc'"):
        pool.events.emit("alloc", [1])
    monkeypatch.setenv("HF_PAGEDKV_EVENTS", "0.25")
    assert BlockPool().events.enabled and BlockPool().events.sample_rate == 0.25
    monkeypatch.setenv("HF_PAGEDKV_EVENTS", "yes")
    with pytest.raises(ValueError, match="HF_PAGEDKV_EVENTS='yes'"):
        BlockPool()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "header"}\n{"n": 0, "kind": "allocate", "blocks": [1]}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:3: not a JSON line"):
        read_trace(bad)
