"""A hypothesis state machine driving several `PagedCache` objects on one `BlockPool` through the real API.

Random sequences of: new cache + prefill, decode steps of 1..5 tokens (distinct rows, identical rows that the cache
may store once, identical rows that differ only in the second layer, or a batch k times larger that makes the cache
fork its rows), fork, beam-like reorders with repeats, batch_select_indices, batch_repeat_interleave, crop and
release. A new cache may declare left padding first (`set_padding`): its whole blocks of padding name the pool's pad
block and read back as zeros. The K/V are fake (2 layers, 1 KV head, head_dim 2, `tests/fake_kv.py`): every token's key is
``(label, position)``, so a row's read-back names the writes it came from.

The reference model is a list of labels per row and layer. After every step: `pool.check_invariants()`, every row of
every cache reads back exactly its reference (in both layers), the K/V returned by `update` are the reference,
every row owns ceil(n / B) blocks. A fixed-size pool makes some steps fail with `PoolExhaustedError`; those must
change nothing. At teardown every cache is released and no block is in use.
"""

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError
from tests.fake_kv import kv_labels

LAYERS = 2
MAX_ROWS = 6


def expected(rows: list[list[int | None]]) -> torch.Tensor:
    """Keys `[batch, 1, n, 2]` of rows (of n >= 1 tokens each) whose tokens carry these labels (None: a token in
    the pad block, which reads as zeros)."""
    labels = torch.tensor([[0 if lab is None else lab for lab in r] for r in rows], dtype=torch.float32)  # [batch, n]
    pos = torch.arange(labels.shape[1], dtype=torch.float32).expand_as(labels)  # [batch, n]
    pad = torch.tensor([[lab is None for lab in r] for r in rows], dtype=torch.bool)  # [batch, n]
    return torch.stack([labels, pos.masked_fill(pad, 0)], -1)[:, None]  # [batch, 1, n, 2]


class Ref:
    """What one cache must hold: `rows[layer][row]` = the label of each token."""

    def __init__(self) -> None:
        self.rows: list[list[list[int]]] = [[] for _ in range(LAYERS)]

    @property
    def num_rows(self) -> int:
        return len(self.rows[0])

    @property
    def num_tokens(self) -> int:
        return len(self.rows[0][0]) if self.rows[0] else 0

    def select(self, idx: list[int]) -> None:
        self.rows = [[list(layer[i]) for i in idx] for layer in self.rows]

    def copy(self) -> "Ref":
        other = Ref()
        other.rows = [[list(r) for r in layer] for layer in self.rows]
        return other


class PagedCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.caches: dict[int, tuple[PagedCache, Ref]] = {}
        self.next_id = 0
        self.next_label = 1

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _labels(self, n: int) -> list[int]:
        out = list(range(self.next_label, self.next_label + n))
        self.next_label += n
        return out

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.caches)), label="cache")

    def _step(self, cache: PagedCache, ref: Ref, layer_labels: list[list[int]], q: int,
              pad_tokens: list[int] | None = None) -> None:
        """Write `q` tokens per row (row labels per layer) through `update`, layer by layer; on a full pool check
        nothing changed. Updates `ref` on success. `pad_tokens`: a prefill's tokens per row in the pad block."""
        batch = len(layer_labels[0])
        start = ref.num_tokens
        new_ref = Ref()
        if ref.num_tokens == 0:
            base = [[[] for _ in range(batch)] for _ in range(LAYERS)]
        else:  # the cache forks its rows when the batch is a multiple of them
            k = batch // ref.num_rows
            base = [[list(layer[r // k]) for r in range(batch)] for layer in ref.rows]
        new_ref.rows = [[base[layer][r] + [layer_labels[layer][r]] * q for r in range(batch)]
                        for layer in range(LAYERS)]
        for layer in new_ref.rows:
            for row, n in zip(layer, pad_tokens or []):
                row[:n] = [None] * n
        for layer in range(LAYERS):
            k, v = kv_labels(layer_labels[layer], start, q)
            try:
                got_k, got_v = cache.update(k, v, layer_idx=layer)
            except PoolExhaustedError:
                if layer == 0:  # nothing was changed: the reference stays as it was
                    if start == 0:  # (an empty cache takes the batch size it is given, still holding nothing)
                        ref.rows = [[[] for _ in range(cache.num_rows)] for _ in range(LAYERS)]
                        if pad_tokens is not None:  # forget the declared padding too (and the rows)
                            cache.reset()
                            ref.rows = [[] for _ in range(LAYERS)]
                    return
                # A duplicate row turned out different in a later layer and its copy did not fit: the forward
                # step is broken off, so the cache must be released (as a model's caller would after the error).
                cache.release()
                self.caches = {i: c for i, c in self.caches.items() if c[0] is not cache}
                return
            want = expected(new_ref.rows[layer])
            assert torch.equal(got_k, want), (layer, got_k[..., 0], want[..., 0])
            assert torch.equal(got_v[..., 0], -want[..., 0]) and torch.equal(got_v[..., 1], want[..., 1])
        ref.rows = new_ref.rows

    # -- rules -----------------------------------------------------------------------------------------------------
    @initialize(block_size=st.sampled_from([1, 2, 3, 4, 8]), num_blocks=st.sampled_from([None, 12, 40]))
    def make_pool(self, block_size, num_blocks):
        self.pool = BlockPool(block_size=block_size, num_blocks=num_blocks, debug=True)

    @precondition(lambda self: len(self.caches) < 5)
    @rule(batch=st.integers(1, 3), n=st.integers(1, 12), debug=st.booleans(), identical=st.booleans(),
          data=st.data())
    def new_cache(self, batch, n, debug, identical, data):
        cache = PagedCache(pool=self.pool, debug=debug)
        ref = Ref()
        labels = self._labels(1) * batch if identical else self._labels(batch)
        self.caches[self.next_id] = (cache, ref)
        self.next_id += 1
        padding = data.draw(st.none() | st.lists(st.integers(0, n - 1), min_size=batch, max_size=batch),
                            label="left padding")
        pad_tokens = None
        if padding is not None:
            mask = torch.ones((batch, n), dtype=torch.long)
            for r, p in enumerate(padding):
                mask[r, :p] = 0
            cache.set_padding(mask)
            B = self.pool.block_size
            pad_tokens = [p // B * B for p in padding]  # whole blocks of padding: in the pad block
        self._step(cache, ref, [labels] * LAYERS, n, pad_tokens)

    @precondition(lambda self: self.caches)
    @rule(data=st.data(), q=st.integers(1, 5), kind=st.sampled_from(["distinct", "identical", "split", "expand"]))
    def decode(self, data, q, kind):
        cache, ref = self.caches[self._pick(data)]
        rows = ref.num_rows or data.draw(st.integers(1, 3), label="rows of an empty cache")
        if kind == "expand" and ref.num_tokens and rows * 2 <= MAX_ROWS:
            factor = data.draw(st.integers(2, MAX_ROWS // rows), label="expand factor")
            rows *= factor
            same = data.draw(st.booleans(), label="copies identical")  # num_return_sequences: yes
            labels = [lab for lab in self._labels(rows // factor) for _ in range(factor)] if same else \
                self._labels(rows)
            layer_labels = [labels] * LAYERS
        elif kind in ("identical", "split"):
            labels = self._labels(1) * rows
            # "split": the rows look identical in layer 0 (so they may be stored once) but differ in layer 1
            layer_labels = [labels, self._labels(rows) if kind == "split" else labels]
        else:
            labels = self._labels(rows)
            layer_labels = [labels] * LAYERS
        self._step(cache, ref, layer_labels, q)

    @precondition(lambda self: self.caches and len(self.caches) < 5)
    @rule(data=st.data())
    def fork(self, data):
        cache, ref = self.caches[self._pick(data)]
        self.caches[self.next_id] = (cache.fork(), ref.copy())
        self.next_id += 1

    @precondition(lambda self: any(ref.num_rows for _, ref in self.caches.values()))
    @rule(data=st.data())
    def reorder(self, data):
        cache, ref = self.caches[data.draw(st.sampled_from(sorted(i for i, (_, r) in self.caches.items()
                                                                   if r.num_rows)), label="cache")]
        n = ref.num_rows
        perm = data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n), label="beam_idx")
        cache.reorder_cache(torch.tensor(perm))
        ref.select(perm)

    @precondition(lambda self: any(ref.num_rows for _, ref in self.caches.values()))
    @rule(data=st.data())
    def select_rows(self, data):
        cache, ref = self.caches[data.draw(st.sampled_from(sorted(i for i, (_, r) in self.caches.items()
                                                                   if r.num_rows)), label="cache")]
        idx = data.draw(st.lists(st.integers(0, ref.num_rows - 1), min_size=1, max_size=ref.num_rows, unique=True)
                        .map(sorted), label="indices")
        cache.batch_select_indices(torch.tensor(idx))
        ref.select(idx)

    @precondition(lambda self: any(0 < ref.num_rows <= MAX_ROWS // 2 for _, ref in self.caches.values()))
    @rule(data=st.data())
    def repeat_rows(self, data):
        cache, ref = self.caches[data.draw(st.sampled_from(sorted(i for i, (_, r) in self.caches.items()
                                                                   if 0 < r.num_rows <= MAX_ROWS // 2)))]
        k = data.draw(st.integers(2, MAX_ROWS // ref.num_rows), label="repeats")
        cache.batch_repeat_interleave(k)
        ref.select([r for r in range(ref.num_rows) for _ in range(k)])

    @precondition(lambda self: any(ref.num_tokens for _, ref in self.caches.values()))
    @rule(data=st.data())
    def crop(self, data):
        cache, ref = self.caches[data.draw(st.sampled_from(sorted(i for i, (_, r) in self.caches.items()
                                                                   if r.num_tokens)), label="cache")]
        m = data.draw(st.integers(0, ref.num_tokens), label="tokens to remove")
        cache.crop(-m)
        keep = ref.num_tokens - m
        ref.rows = [[r[:keep] for r in layer] for layer in ref.rows]

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def release(self, data):
        i = self._pick(data)
        self.caches.pop(i)[0].release()

    # -- checks after every step -------------------------------------------------------------------------------------
    @invariant()
    def pool_is_sound(self):
        if self.pool is None:
            return
        self.pool.check_invariants()
        B = self.pool.block_size
        live = set()
        for cache, ref in self.caches.values():
            n = ref.num_tokens
            assert cache.get_seq_length() == n
            tables = cache.block_tables()
            if n:
                assert len(tables) == ref.num_rows
                assert [len(t) for t in tables] == [math.ceil(n / B)] * len(tables)
                for layer in range(LAYERS):
                    k, v = cache.layers[layer].keys, cache.layers[layer].values
                    want = expected(ref.rows[layer])
                    assert torch.equal(k, want), (layer, k[..., 0], want[..., 0])
                    assert torch.equal(v[..., 0], -want[..., 0]) and torch.equal(v[..., 1], want[..., 1])
            else:
                assert all(t == [] for t in tables)
            live.update(b for t in tables for b in t)
        pads = {g.pad_block for g in self.pool.groups if g.pad_block is not None}  # held by the pool, named or not
        assert self.pool.stats().blocks_in_use == len(live | pads)

    def teardown(self):
        for cache, _ in self.caches.values():
            cache.release()
        if self.pool is not None:
            self.pool.check_invariants()
            assert self.pool.stats().blocks_in_use == sum(g.pad_block is not None for g in self.pool.groups)


PagedCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestPagedCacheStateMachine = PagedCacheMachine.TestCase
