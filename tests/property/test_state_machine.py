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

The same machine drives three more pools:

- quantized, `k8v4` and `k4v4` (`QuantizedPagedCacheMachine`): codes are lossy, so a read must be within the codec's
  error bound of the reference instead of equal to it. Keys are grouped per channel over a block's tokens, so the
  bound of a key comes from every value its block has held in that row (a crop that cuts into an encoded block keeps
  the decoded tokens and encodes them again when the block refills: twice the bound); values are grouped per token.
- prefix caching (`PrefixCachingMachine`): new caches attach (`PagedCache.from_prefix`) to the published blocks of a
  few shared documents and compute only the rest, and any cache may `publish` its rows; a token id names its labels
  in both layers, so an attached block must read back exactly the labels its ids name.
"""

import math

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import LlamaConfig

from hf_pagedkv import BlockPool, PagedCache, PoolExhaustedError, QuantConfig
from tests.fake_kv import kv_labels

LAYERS = 2
MAX_ROWS = 6
#: a token id of the prefix-caching machine is ``label_layer0 * ID_BASE + label_layer1``
ID_BASE = 10**6
#: the shared documents new caches of the prefix-caching machine start from: token `i` of document `d` has label
#: ``100_000 + 1000 * d + i`` in both layers
DOCS = [[(100_000 + 1000 * d + i) * (ID_BASE + 1) for i in range(16)] for d in range(3)]
#: the model config of the prefix-caching machine's caches (`from_prefix` builds the layers from it)
CONFIG = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=1, num_key_value_heads=1, hidden_size=2,
                     head_dim=2, intermediate_size=4, vocab_size=8)


def expected(rows: list[list[int | None]]) -> torch.Tensor:
    """Keys `[batch, 1, n, 2]` of rows (of n >= 1 tokens each) whose tokens carry these labels (None: a token in
    the pad block, which reads as zeros)."""
    labels = torch.tensor([[0 if lab is None else lab for lab in r] for r in rows], dtype=torch.float32)  # [batch, n]
    pos = torch.arange(labels.shape[1], dtype=torch.float32).expand_as(labels)  # [batch, n]
    pad = torch.tensor([[lab is None for lab in r] for r in rows], dtype=torch.bool)  # [batch, n]
    return torch.stack([labels, pos.masked_fill(pad, 0)], -1)[:, None]  # [batch, 1, n, 2]


def key_bound(bits: int, low: float, high: float) -> float:
    """The most a key decoded from `bits`-bit codes may differ from what was written, for a group whose values lie
    in [low, high]: int8 is symmetric (``absmax / 254``), int4 asymmetric (``range / 30``); twice that, as a block
    may be encoded a second time after a crop, plus fp16 rounding of the scale and minimum."""
    absmax = max(abs(low), abs(high))
    one = absmax / 254 if bits == 8 else (high - low) / (2**bits - 1) / 2
    return 2 * one + absmax * 2**-9 + 1e-4


def check_read(keys: torch.Tensor, values: torch.Tensor, ref: "Ref", layer: int, quant: QuantConfig | None,
               block_size: int, returned: bool = False) -> None:
    """`keys` / `values` `[batch, 1, n, 2]` read back (or returned by `update`: `returned`) are those of `ref`'s rows
    in `layer`: exactly in full precision, within the codec's bound when quantized (`key_bound`; values are grouped
    per token, so their bound comes from the token's own two channels).

    NOTE: what a quantized store's `update` returns for the step's own tokens is the step's input, also at left
    padding in the pad block (the full-precision store returns the pad block's zeros there); the attention masks
    those positions, so they are left out of that comparison. Reads from the cache give zeros in both."""
    want = expected(ref.rows[layer])  # [batch, 1, n, 2]
    want_v = torch.stack([-want[..., 0], want[..., 1]], -1)  # values are (-label, position)
    if returned and quant is not None and quant.is_quantized:  # (masked positions: take what was returned)
        pad = torch.tensor([[lab is None for lab in row] for row in ref.rows[layer]])[:, None, :, None]
        want, want_v = torch.where(pad, keys, want), torch.where(pad, values, want_v)
    if quant is None or not quant.is_quantized:
        assert torch.equal(keys, want), (layer, keys[..., 0], want[..., 0])
        assert torch.equal(values, want_v), (layer, values[..., 0], want_v[..., 0])
        return
    n = want.shape[2]
    key_tol = torch.tensor([[[[key_bound(quant.key_bits, *ref.history[layer][r][p // block_size][c]) for c in (0, 1)]
                              for p in range(n)]] for r in range(ref.num_rows)])  # [batch, 1, n, 2]
    low, high = want_v.amin(-1, keepdim=True), want_v.amax(-1, keepdim=True)  # [batch, 1, n, 1]: a token's group
    one = (high - low) / (2**quant.value_bits - 1) / 2  # asymmetric int4
    value_tol = 2 * one + torch.maximum(low.abs(), high.abs()) * 2**-9 + 1e-4
    assert ((keys - want).abs() <= key_tol).all(), (layer, keys[..., 0], want[..., 0], key_tol[..., 0])
    assert ((values - want_v).abs() <= value_tol).all(), (layer, values[..., 0], want_v[..., 0])


class Ref:
    """What one cache must hold: `rows[layer][row]` = the label of each token; for a quantized pool,
    `history[layer][row][block]` = per key channel, the (lowest, highest) value that block has held in that row."""

    def __init__(self) -> None:
        self.rows: list[list[list[int]]] = [[] for _ in range(LAYERS)]
        self.history: list[list[list[list[tuple[float, float]]]]] = [[] for _ in range(LAYERS)]

    @property
    def num_rows(self) -> int:
        return len(self.rows[0])

    @property
    def num_tokens(self) -> int:
        return len(self.rows[0][0]) if self.rows[0] else 0

    def select(self, idx: list[int]) -> None:
        self.rows = [[list(layer[i]) for i in idx] for layer in self.rows]
        self.history = [[list(layer[i]) for i in idx] for layer in self.history]

    def copy(self) -> "Ref":
        other = Ref()
        other.rows = [[list(r) for r in layer] for layer in self.rows]
        other.history = [[list(r) for r in layer] for layer in self.history]
        return other

    def crop_to(self, keep: int, block_size: int) -> None:
        """Keep the first `keep` tokens; a block cut into keeps its history, a block dropped whole forgets it."""
        self.rows = [[r[:keep] for r in layer] for layer in self.rows]
        self.history = [[h[: math.ceil(keep / block_size)] for h in layer] for layer in self.history]

    def record(self, start: int, block_size: int) -> None:
        """Add the tokens from position `start` on to the key history of their blocks (rows already updated)."""
        for layer in range(LAYERS):
            for r, row in enumerate(self.rows[layer]):
                hist = self.history[layer][r]
                for p in range(start, len(row)):
                    j, key = p // block_size, (0.0 if row[p] is None else float(row[p]), 0.0 if row[p] is None else p)
                    if j == len(hist):
                        hist.append([(key[0], key[0]), (key[1], key[1])])
                    hist[j] = [(min(lo, x), max(hi, x)) for (lo, hi), x in zip(hist[j], key)]


class PagedCacheMachine(RuleBasedStateMachine):
    QUANT: str | None = None  # the pool's QuantConfig preset (None: full precision, reads compared exactly)
    BLOCK_SIZES = (1, 2, 3, 4, 8)

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
            new_ref.history = [[[] for _ in range(batch)] for _ in range(LAYERS)]
        else:  # the cache forks its rows when the batch is a multiple of them
            k = batch // ref.num_rows
            base = [[list(layer[r // k]) for r in range(batch)] for layer in ref.rows]
            new_ref.history = [[list(layer[r // k]) for r in range(batch)] for layer in ref.history]
        new_ref.rows = [[base[layer][r] + [layer_labels[layer][r]] * q for r in range(batch)]
                        for layer in range(LAYERS)]
        for layer in new_ref.rows:
            for row, n in zip(layer, pad_tokens or []):
                row[:n] = [None] * n
        new_ref.record(start, self.pool.block_size)
        for layer in range(LAYERS):
            k, v = kv_labels(layer_labels[layer], start, q)
            try:
                got_k, got_v = cache.update(k, v, layer_idx=layer)
            except PoolExhaustedError:
                if layer == 0:  # nothing was changed: the reference stays as it was
                    if start == 0:  # (an empty cache takes the batch size it is given, still holding nothing)
                        ref.rows = [[[] for _ in range(cache.num_rows)] for _ in range(LAYERS)]
                        ref.history = [[[] for _ in range(cache.num_rows)] for _ in range(LAYERS)]
                        if pad_tokens is not None:  # forget the declared padding too (and the rows)
                            cache.reset()
                            ref.rows, ref.history = [[] for _ in range(LAYERS)], [[] for _ in range(LAYERS)]
                    return
                # A duplicate row turned out different in a later layer and its copy did not fit: the forward
                # step is broken off, so the cache must be released (as a model's caller would after the error).
                cache.release()
                self.caches = {i: c for i, c in self.caches.items() if c[0] is not cache}
                return
            check_read(got_k, got_v, new_ref, layer, self.pool.quant, self.pool.block_size, returned=True)
        ref.rows, ref.history = new_ref.rows, new_ref.history

    # -- rules -----------------------------------------------------------------------------------------------------
    @initialize(data=st.data(), num_blocks=st.sampled_from([None, 12, 40]))
    def make_pool(self, data, num_blocks):
        block_size = data.draw(st.sampled_from(self.BLOCK_SIZES), label="block_size")
        self.pool = BlockPool(block_size=block_size, num_blocks=num_blocks, debug=True, quant=self.QUANT)

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
        ref.crop_to(ref.num_tokens - m, self.pool.block_size)

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
                    check_read(cache.layers[layer].keys, cache.layers[layer].values, ref, layer, self.pool.quant, B)
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


class QuantizedPagedCacheMachine(PagedCacheMachine):
    """The machine on a quantized pool (`QUANT` set per subclass); int4 packs two tokens a byte: even blocks."""

    BLOCK_SIZES = (2, 4, 8)


class K8V4Machine(QuantizedPagedCacheMachine):
    QUANT = "k8v4"


class K4V4Machine(QuantizedPagedCacheMachine):
    QUANT = "k4v4"


class PrefixCachingMachine(PagedCacheMachine):
    """The machine on a prefix-caching pool: new caches attach to the published blocks of `DOCS` and may go on
    past them with fresh tokens; `publish` offers any cache's rows to later ones. No left padding here (a padded row
    is never published)."""

    def _ids(self, ref: Ref, r: int) -> list[int]:
        """Row `r`'s token ids: each token's labels in both layers."""
        return [a * ID_BASE + b for a, b in zip(ref.rows[0][r], ref.rows[1][r])]

    @initialize(data=st.data(), num_blocks=st.sampled_from([None, 12, 40]))
    def make_pool(self, data, num_blocks):
        block_size = data.draw(st.sampled_from(self.BLOCK_SIZES), label="block_size")
        self.pool = BlockPool(block_size=block_size, num_blocks=num_blocks, debug=True, prefix_caching=True)

    @precondition(lambda self: len(self.caches) < 5)
    @rule(doc=st.integers(0, len(DOCS) - 1), n=st.integers(1, 16), extra=st.integers(0, 4), debug=st.booleans())
    def new_cache(self, doc, n, extra, debug):
        ids = DOCS[doc][:n] + [lab * (ID_BASE + 1) for lab in self._labels(extra)]
        try:
            cache = PagedCache.from_prefix(self.pool, ids, config=CONFIG, debug=debug)
        except PoolExhaustedError:  # (the cache is released again: nothing changed)
            return
        hit = cache.get_seq_length()
        B = self.pool.block_size
        assert hit % B == 0 and hit < len(ids)  # whole blocks, and at least one token left to compute
        event(f"attached blocks: {'some' if hit else 'none'}")  # (--hypothesis-show-statistics)
        ref = Ref()
        ref.rows = [[[divmod(i, ID_BASE)[layer] for i in ids[:hit]]] for layer in range(LAYERS)]
        ref.history = [[[]] for _ in range(LAYERS)]
        ref.record(0, B)
        self.caches[self.next_id] = (cache, ref)
        self.next_id += 1
        for layer in range(LAYERS):  # what the attached blocks hold: exactly the labels their ids name
            if hit:
                check_read(cache.layers[layer].keys, cache.layers[layer].values, ref, layer, None, B)
        for i in ids[hit:]:  # the rest, one token per step, as a model's prefill chunks would
            if cache not in (c for c, _ in self.caches.values()) or cache.get_seq_length() != ref.num_tokens:
                return
            before = ref.num_tokens
            self._step(cache, ref, [[divmod(i, ID_BASE)[layer]] for layer in range(LAYERS)], 1)
            if ref.num_tokens == before:  # the pool was full: the cache keeps what it holds
                return

    @precondition(lambda self: any(ref.num_tokens for _, ref in self.caches.values()))
    @rule(data=st.data())
    def publish(self, data):
        cache, ref = self.caches[data.draw(st.sampled_from(sorted(i for i, (_, r) in self.caches.items()
                                                                   if r.num_tokens)), label="cache")]
        B = self.pool.block_size
        published = cache.publish([self._ids(ref, r) for r in range(ref.num_rows)])
        assert 0 <= published <= ref.num_rows * (ref.num_tokens // B)
        event(f"newly published blocks: {'some' if published else 'none'}")
        # a later request for row 0's tokens attaches to every full block of it but the one holding its last token
        ids = self._ids(ref, 0)
        probe = PagedCache.from_prefix(self.pool, ids, config=CONFIG)
        try:
            assert probe.get_seq_length() == (len(ids) - 1) // B * B
        finally:
            probe.release()


# max_examples x stateful_step_count bound each machine's time: 10-30 s each on one shared core
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
PagedCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, **_SETTINGS)
TestPagedCacheStateMachine = PagedCacheMachine.TestCase
K8V4Machine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, **_SETTINGS)
TestK8V4StateMachine = K8V4Machine.TestCase
K4V4Machine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, **_SETTINGS)
TestK4V4StateMachine = K4V4Machine.TestCase
PrefixCachingMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, **_SETTINGS)
TestPrefixCachingStateMachine = PrefixCachingMachine.TestCase
