"""Large steps give the C heap's free pages back (`storage/heap.py`); small steps do not pay for it."""

import platform

import hf_pagedkv.storage.heap as heap_module
from hf_pagedkv import PagedCache
from hf_pagedkv.storage.heap import TRIM_MIN_TOKENS, trim_heap
from tests.fake_kv import kv


def test_trim_heap_calls_malloc_trim_0_where_glibc_has_it_and_says_so(monkeypatch):
    # glibc (this test machine's C library, if it is Linux/glibc) has malloc_trim: the real call trims and says so
    assert trim_heap() is (platform.libc_ver()[0] == "glibc")
    calls = []
    monkeypatch.setattr(heap_module, "_malloc_trim", lambda: calls.append)
    assert trim_heap() is True and calls == [0]  # trims everything: pad 0
    monkeypatch.setattr(heap_module, "_malloc_trim", lambda: None)  # macOS, musl, Windows
    assert trim_heap() is False


def test_a_prefill_trims_once_per_layer_and_a_decode_step_not_at_all(monkeypatch):
    calls = []
    monkeypatch.setattr(heap_module, "trim_heap", lambda: calls.append(1) or True)
    cache = PagedCache(block_size=16)
    for layer in range(3):
        cache.update(*kv(1, 0, TRIM_MIN_TOKENS, 1.0), layer)
    assert len(calls) == 3
    for layer in range(3):
        cache.update(*kv(1, TRIM_MIN_TOKENS, 1, 2.0), layer)
    assert len(calls) == 3
    for layer in range(3):  # just below the threshold: no trim
        cache.update(*kv(1, TRIM_MIN_TOKENS + 1, TRIM_MIN_TOKENS - 1, 3.0), layer)
    assert len(calls) == 3 and cache.get_seq_length() == 2 * TRIM_MIN_TOKENS
    cache.pool.check_invariants()
    cache.release()
