"""`SegmentedTensor`: one logical `[d0, length, d2]` storage tensor kept as a list of segments along dim 1."""

from __future__ import annotations

import bisect
import itertools

import torch

from hf_pagedkv.storage.row_gather import RowGather
from hf_pagedkv.storage.segment_split import SegmentSplit

_GENERATIONS = itertools.count()  # `SegmentedTensor.generation`s, process-wide


class SegmentedTensor:
    """A tensor of shape `[d0, length, d2]` stored as segments `[d0, n_i, d2]` that together cover ``0 .. length``
    along dim 1 (the slot axis of a page store, or the block axis of a quantized store's codes and scales).

    Why: a growing pool that reallocated one tensor would hold the old and the new storage at once and copy
    everything (a peak of twice the cache). Growing appends a segment, copying nothing; shrinking drops the last
    segments. Index `i` lives in segment ``s`` with ``starts[s] <= i < starts[s] + n_s``, at ``i - starts[s]``.

    Reads that stay in one segment are served by that segment alone: `narrow` returns a **view** (what makes a
    batch-1 row whose blocks are consecutive zero-copy), `index_select` / `index_copy_` / `index_fill_` one op.
    Indices spread over several segments are split per segment (a gather); `narrow` across a boundary copies.

    The methods take `dim` for the look of torch's; only ``dim=1`` is supported. Invariant: `segments` are
    non-empty, on one device with one dtype and equal `d0`, `d2`; ``starts[s] == sum(n_0 .. n_{s-1})``.
    """

    def __init__(self, d0: int, d2: int, dtype: torch.dtype, device: torch.device) -> None:
        self.d0, self.d2 = d0, d2  # the two fixed dims; fixed
        self.dtype, self.device = dtype, device  # of every segment; fixed
        self.segments: list[torch.Tensor] = []  # [d0, n_s, d2] each; changed by append/pop_segment only
        self.starts: list[int] = []  # first index of each segment along dim 1
        self.length = 0  # total along dim 1
        self._bounds: dict[torch.device, torch.Tensor] = {}  # device -> starts[1:] as int64, for bucketize
        # a number no other state of any SegmentedTensor of the process has had; a new one whenever `segments`
        # changes: a reader that kept the segments' addresses (`NativeCodeAttention`) knows whether they still hold
        self.generation = next(_GENERATIONS)

    # -- shape ------------------------------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.d0, self.length, self.d2))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.segments)

    def __len__(self) -> int:
        return len(self.segments)

    # NOTE: storage outlives the call that creates it. Made inside `torch.inference_mode()` it would be an inference
    # tensor, which a later write outside that mode may not update in place; so it is always made outside it.
    @torch.inference_mode(False)
    def append_segment(self, n: int, fill: float | int | None = None) -> None:
        """Add a segment of `n` entries at the end (uninitialized when `fill` is None, else filled with it)."""
        assert n > 0, "a segment holds at least one entry"
        shape = (self.d0, n, self.d2)
        t = (torch.empty(shape, dtype=self.dtype, device=self.device) if fill is None
             else torch.full(shape, fill, dtype=self.dtype, device=self.device))
        self.segments.append(t)
        self.starts.append(self.length)
        self.length += n
        self._bounds.clear()
        self.generation = next(_GENERATIONS)

    def pop_segment(self) -> int:
        """Drop the last segment (its memory goes back to the allocator); return its length."""
        t = self.segments.pop()
        self.starts.pop()
        self.length -= t.shape[1]
        self._bounds.clear()
        self.generation = next(_GENERATIONS)
        return t.shape[1]

    def materialize(self) -> torch.Tensor:
        """The whole tensor, `[d0, length, d2]` (a copy when there are several segments; for tests and tools)."""
        if len(self.segments) == 1:
            return self.segments[0]
        return torch.cat(self.segments, 1) if self.segments else torch.empty(self.shape, dtype=self.dtype,
                                                                              device=self.device)

    # -- locating ---------------------------------------------------------------------------------------------------
    def _segment_of(self, i: int) -> int:
        return bisect.bisect_right(self.starts, i) - 1

    def split(self, index: torch.Tensor, size: int = 1) -> SegmentSplit:
        """Where the entries of 1-D `index` (`[n]` int64) lie among the segments; pass it to the operations below
        to reuse it for every tensor with the same segments (one host sync per split when there are several).

        `size` > 1: `index` names chunks of `size` consecutive entries (every segment's length a multiple of it).
        """
        if len(self.segments) == 1:
            return SegmentSplit(0, index, (), size)
        starts = self.starts if size == 1 else [start // size for start in self.starts]
        bounds = self._bounds.get((index.device, size))
        if bounds is None:
            bounds = self._bounds[(index.device, size)] = torch.tensor(starts[1:], dtype=torch.long,
                                                                       device=index.device)
        seg = torch.bucketize(index.contiguous(), bounds, right=True)  # [n] segment of each entry
        counts = torch.bincount(seg, minlength=len(starts)).tolist()
        base = max(range(len(counts)), key=counts.__getitem__)
        if counts[base] == len(index):
            return SegmentSplit(base, index - starts[base] if starts[base] else index, (), size)
        last = self.segments[base].shape[1] // size - 1
        base_local = (index - starts[base]).clamp_(0, last)  # [n]; entries elsewhere are patched
        parts = []
        for s, count in enumerate(counts):
            if count:
                pos = (seg == s).nonzero().squeeze(1)  # [n_s] entries of `index` in segment s
                parts.append((s, pos, index.index_select(0, pos) - starts[s]))
        return SegmentSplit(base, base_local, tuple(parts), size)

    def row_gather(self, index: torch.Tensor, size: int, split: SegmentSplit | None = None) -> RowGather:
        """The plan of `gather_rows` for chunk ids `index` (`[batch, n]` int64, chunks of `size` entries);
        `split`: ``self.split(index.reshape(-1), size)`` when the caller has it. Reusable by every tensor with
        these segments and this `d0`."""
        batch, n = index.shape
        split = split if split is not None else self.split(index.reshape(-1), size)
        assert split.size == size, "the split was made for another chunk size"
        heads = torch.arange(self.d0, device=index.device).view(1, self.d0, 1)  # [1, d0, 1]

        def chunks(s: int) -> int:  # chunks in segment s: head h's chunk c is row h * chunks(s) + c of its matrix
            return self.segments[s].shape[1] // size

        base_rows = heads * chunks(split.base) + split.base_local.view(batch, 1, n)  # [batch, d0, n]
        patches = []
        for s, pos, local in split.patches:  # pos: entries b * n + j of the [batch * n] index, local: their chunks
            row, col = (pos // n).view(-1, 1), (pos % n).view(-1, 1)  # [m, 1] each
            out_rows = (row * self.d0 + heads.view(1, -1)) * n + col  # [m, d0] rows of the output matrix
            src_rows = heads.view(1, -1) * chunks(s) + local.view(-1, 1)  # [m, d0] rows of segment s's matrix
            patches.append((s, out_rows.reshape(-1), src_rows.reshape(-1)))
        return RowGather(batch, self.d0, n, split.base, base_rows.reshape(-1), tuple(patches), size)

    def gather_rows(self, plan: RowGather) -> torch.Tensor:
        """Whole chunks of `size` entries for a batch, batch-major: `[batch, d0, n * size, d2]` contiguous, where
        ``out[b, h, j * size + i] = self[h, index[b, j] * size + i]`` for the `index` the plan was made from. One
        `index_select` along dim 0 of the base segment's `[d0 * n_s, size * d2]` matrix, plus one per other segment
        touched (copied over its rows)."""
        width = plan.size * self.d2
        base = self.segments[plan.base].view(-1, width)  # [d0 * n_base, size * d2]
        out = base.index_select(0, plan.base_rows)  # [batch * d0 * n, size * d2]
        for s, out_rows, src_rows in plan.patches:
            out.index_copy_(0, out_rows, self.segments[s].view(-1, width).index_select(0, src_rows))
        return out.view(plan.batch, self.d0, plan.n * plan.size, self.d2)  # [batch, d0, n * size, d2]

    def _view(self, s: int, size: int) -> torch.Tensor:
        seg = self.segments[s]
        return seg if size == 1 else seg.view(self.d0, -1, size * self.d2)  # [d0, n_s / size, size * d2]

    def _pieces(self, split: SegmentSplit):
        """Yield `(segment, positions, local)` for each segment `split` touches (`positions` into the index, None
        for all of it): what a write or fill goes through."""
        if split.single:
            yield self.segments[split.base], None, split.base_local
        for s, pos, local in split.parts:
            yield self.segments[s], pos, local

    def _gather(self, split: SegmentSplit, out: torch.Tensor | None) -> torch.Tensor:
        """One `index_select` from the base segment for every entry, then the entries of other segments copied
        over theirs: a single pass over the output when all lie in one segment."""
        base = self._view(split.base, split.size)
        if out is None:
            out = base.index_select(1, split.base_local)
        else:
            torch.index_select(base, 1, split.base_local, out=out)
        for s, pos, local in split.patches:
            out.index_copy_(1, pos, self._view(s, split.size).index_select(1, local))
        return out

    # -- the tensor operations a store uses (dim 1 only) -------------------------------------------------------------
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries ``start .. start + length - 1``, `[d0, length, d2]`: a view when they lie in one segment, else a
        copy."""
        assert dim == 1
        s = self._segment_of(start)
        local = start - self.starts[s]
        if local + length <= self.segments[s].shape[1]:
            return self.segments[s].narrow(1, local, length)  # a view: no copy
        parts, end = [], start + length
        while start < end:
            s = self._segment_of(start)
            local = start - self.starts[s]
            take = min(end - start, self.segments[s].shape[1] - local)
            parts.append(self.segments[s].narrow(1, local, take))
            start += take
        return torch.cat(parts, 1)  # [d0, length, d2]

    def strided_rows(self, batch: int, start: int, length: int, stride: int) -> torch.Tensor | None:
        """Entries ``start + r * stride .. start + r * stride + length - 1`` of rows ``r < batch``, as one **view**
        `[batch, d0, length, d2]` (strides ``(stride * d2, n_s * d2, d2, 1)``) when they all lie in one segment;
        `None` otherwise (the caller gathers)."""
        s = self._segment_of(start)
        seg, local = self.segments[s], start - self.starts[s]
        if local + (batch - 1) * stride + length > seg.shape[1]:
            return None
        return seg.as_strided((batch, self.d0, length, self.d2), (stride * self.d2, seg.stride(0), self.d2, 1),
                              seg.storage_offset() + local * self.d2)

    def index_select(self, dim: int, index: torch.Tensor, out: torch.Tensor | None = None,
                     split: SegmentSplit | None = None) -> torch.Tensor:
        """Entries `index` (`[n]` int64), `[d0, n, d2]`, into `out` when given; `split`: `self.split(index)`."""
        assert dim == 1
        return self._gather(split if split is not None else self.split(index), out)

    def index_select_chunks(self, index: torch.Tensor, size: int, split: SegmentSplit | None = None) -> torch.Tensor:
        """Whole chunks of `size` consecutive entries (chunk `c` = entries ``c * size .. (c + 1) * size - 1``, e.g.
        the slots of block `c`), `[d0, len(index), size * d2]`: one `index_select` of `size * d2`-element rows from
        the segment holding most of them, plus one per other segment touched. Every segment's length must be a
        multiple of `size` (segments of whole blocks). `split`: `self.split(index, size)`."""
        split = split if split is not None else self.split(index, size)
        assert split.size == size, "the split was made for another chunk size"
        return self._gather(split, None)

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor,
                    split: SegmentSplit | None = None) -> SegmentedTensor:
        """Write `source` `[d0, n, d2]` into entries `index` `[n]`; `split`: `self.split(index)`."""
        assert dim == 1
        for seg, pos, local in self._pieces(split if split is not None else self.split(index)):
            seg.index_copy_(1, local, source if pos is None else source.index_select(1, pos))
        return self

    def index_fill_(self, dim: int, index: torch.Tensor, value: float | int) -> SegmentedTensor:
        """Fill entries `index` `[n]` with `value`."""
        assert dim == 1
        for seg, _, local in self._pieces(self.split(index)):
            seg.index_fill_(1, local, value)
        return self

    def __repr__(self) -> str:
        sizes = [t.shape[1] for t in self.segments]
        return f"SegmentedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, segments={sizes})"
