"""`HostStore`: preallocated host-memory copies of whole KV blocks (the storage half of the host tier)."""

from __future__ import annotations

import torch

from hf_pagedkv.errors import counted

#: export parts only some blocks have (a quantized store's open-block stages and sink tokens): "<part>_rows" lists
#: the blocks that have it, "<layer>.<part>_<what>" tensors hold it, one entry per listed block along dim 1
_PARTS = ("stage", "sink")


class HostStore:
    """Whole blocks of one layer group in host (CPU) memory, in the format the device store's `export_blocks` gives.

    Layout: every exported tensor (one entry per block along dim 1; for a full-precision store ``"{layer}.keys"``
    `[num_kv_heads, n, block_size, key_dim]` and ``"{layer}.values"``) gets one preallocated tensor
    ``[num_kv_heads, num_blocks, block_size, dim]`` in the model dtype, in pinned memory when the device tier is
    CUDA (page-locked memory is what lets a copy run at full PCIe bandwidth and overlap compute). Host block `h`
    is index `h` along dim 1 of each. The storage is allocated once, at the first `write`, from the shapes of that
    export; `num_blocks` is fixed at construction. Parts only some blocks have (a quantized pool's full-precision
    stage of an open block, and sink tokens; see `_PARTS`) are kept per host block in `_sparse`: there are about
    one of each per sequence. Holds no bookkeeping: which ids are free is `HostTier`'s.

    Invariant (`check`): the layout is all or nothing: before the first write no tensor and no part; after it, one
    tensor per dense name of that export, each `[dim0, num_blocks, ...]`, and every part it has (the first
    allocation builds it aside and keeps it only once every tensor is allocated, so a failed allocation leaves none,
    and the next write tries again).

    Copies back to a CUDA device (`read(..., device="cuda:i")`) run on a copy stream of their own (`copy_stream`),
    from pinned memory, without blocking the host; the device's current stream then waits on an event recorded
    after them (`last_copy_event`), so no kernel queued later on it (the import into the page store, attention)
    reads a block before its copy has landed. On the CPU, `read` copies synchronously.
    """

    def __init__(self, num_blocks: int, pin_memory: bool) -> None:
        self.num_blocks = num_blocks  # capacity in blocks; fixed
        self.pin_memory = pin_memory  # pinned host memory (the device tier is CUDA); fixed
        self.tensors: dict[str, torch.Tensor] = {}  # export name -> [dim0, num_blocks, ...] on the CPU; set once
        # part -> {export name -> (dim0, shape after dim 1, dtype)}, from the first write; set once
        self.parts: dict[str, dict[str, tuple[int, tuple[int, ...], torch.dtype]]] = {}
        self._sparse: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (host block, part) -> name -> [dim0, ...]
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # CUDA device -> its copy stream; made by read
        self.last_copy_event: torch.cuda.Event | None = None  # recorded after the last copy to CUDA; set by read

    @property
    def bytes_reserved(self) -> int:
        """Bytes of host memory allocated (0 before the first write), per-block parts included."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + sum(
            t.numel() * t.element_size() for part in self._sparse.values() for t in part.values())

    @torch.inference_mode(False)  # storage outlives the call (see PageStore._new)
    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        """The storage for exports like `tensors`, all of it or (an allocation fails) none."""
        dense, parts = {}, {}
        for name, t in tensors.items():
            part = _part_of(name)
            if part is not None:
                if not name.endswith("_rows"):
                    parts.setdefault(part, {})[name] = (t.shape[0], tuple(t.shape[2:]), t.dtype)
                else:
                    parts.setdefault(part, {})
                continue
            dense[name] = torch.empty((t.shape[0], self.num_blocks, *t.shape[2:]), dtype=t.dtype,
                                      pin_memory=self.pin_memory)
        self.tensors, self.parts = dense, parts

    def mismatch(self, tensors: dict[str, torch.Tensor], n: int) -> str | None:
        """What keeps an export of `n` blocks, `tensors`, from this store's layout (None: it fits). No side
        effects."""
        names = set(self.tensors) | {f"{p}_rows" for p in self.parts} | {k for p in self.parts.values() for k in p}
        if set(tensors) != names:
            return (f"the export names {sorted(set(tensors) - names)[:4]} are not in the layout, its "
                    f"{sorted(names - set(tensors))[:4]} are not in the export")
        for k, t in tensors.items():
            if _part_of(k) is None:
                held = self.tensors[k]
                if tuple(t.shape[:1] + t.shape[2:]) != tuple(held.shape[:1] + held.shape[2:]) or t.shape[1] != n \
                        or held.shape[1] != self.num_blocks or t.dtype != held.dtype:
                    return (f"{k!r} is {t.dtype} {tuple(t.shape)} for {counted(n, 'block')}, the layout holds "
                            f"{held.dtype} {tuple(held.shape)}")
        return None

    def check(self, export: dict[str, torch.Tensor]) -> list[str]:
        """Problems (empty when fine): a layout allocated (by the first write) that does not fit `export`, an
        export of no block of the device store (a partial or stale layout)."""
        if not self.tensors and not self.parts:
            return []
        problem = self.mismatch(export, 0)
        return [f"the host store's layout is broken: {problem}"] if problem else []

    def write(self, host_blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Copy an export of `len(host_blocks)` device blocks into host blocks `host_blocks`, synchronously (the
        device blocks may be reused as soon as this returns).

        Raises:
            ValueError: `tensors` does not have the names and per-block shapes of the first write (another format).
        """
        if not self.tensors:
            self._allocate(tensors)
        problem = self.mismatch(tensors, len(host_blocks))
        if problem is not None:
            raise ValueError(f"HostStore.write: the export does not match this host store's layout: {problem}.")
        idx = torch.tensor(host_blocks, dtype=torch.long)
        for name, t in self.tensors.items():
            t.index_copy_(1, idx, tensors[name].to("cpu"))  # [dim0, n, ...] into [dim0, num_blocks, ...]
        for part, part_names in self.parts.items():
            for h in host_blocks:
                self._sparse.pop((h, part), None)
            for i, r in enumerate(tensors[f"{part}_rows"].tolist()):
                self._sparse[(host_blocks[r], part)] = {
                    name: tensors[name][:, i].to("cpu").clone() for name in part_names}  # [dim0, ...]

    def read(self, host_blocks: list[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The export of host blocks `host_blocks`, as the device store's `import_blocks` takes it, on `device`:
        ``name -> [dim0, len(host_blocks), ...]``. To a CUDA device the copies are asynchronous, on `copy_stream`,
        and the current stream waits for them (see the class docstring)."""
        device = torch.device(device)
        cuda = device.type == "cuda"
        stream = self.copy_stream(device) if cuda else None
        idx = torch.tensor(host_blocks, dtype=torch.long)
        host: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            picked = t.index_select(1, idx)  # [dim0, n, ...] on the CPU
            host[name] = picked.pin_memory() if cuda and self.pin_memory else picked
        for part, part_names in self.parts.items():
            rows = [i for i, h in enumerate(host_blocks) if (h, part) in self._sparse]
            host[f"{part}_rows"] = torch.tensor(rows, dtype=torch.long)
            for name, (dim0, tail, dtype) in part_names.items():
                if rows:  # [dim0, len(rows), ...]
                    host[name] = torch.stack([self._sparse[(host_blocks[i], part)][name] for i in rows], 1)
                else:
                    host[name] = torch.empty((dim0, 0, *tail), dtype=dtype)
        if not cuda:
            return {name: t.to(device) for name, t in host.items()}
        out = {}
        with torch.cuda.stream(stream):
            for name, t in host.items():
                # NOTE: a `*_rows` index list stays on the CPU, as `export_blocks` gives it
                out[name] = t if name.endswith("_rows") else t.to(device, non_blocking=self.pin_memory)
        event = torch.cuda.Event()
        event.record(stream)
        compute = torch.cuda.current_stream(device)
        compute.wait_event(event)  # what is queued on the compute stream from now on runs after the copies
        for t in out.values():
            if t.is_cuda:
                t.record_stream(compute)  # allocated on the copy stream, used on the compute stream
        self.last_copy_event = event
        return out

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The CUDA stream copies back to `device` run on (one per device, made on first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def select_blocks(export: dict[str, torch.Tensor], positions: list[int]) -> dict[str, torch.Tensor]:
    """The export of the blocks at `positions` (indices along dim 1) of a block export, in that order, with its
    per-block parts (`_PARTS`: ``"<part>_rows"`` and the tensors listing one entry per such block) re-indexed."""
    pos = torch.tensor(positions, dtype=torch.long)
    out = {name: t.index_select(1, pos.to(t.device))  # [dim0, len(positions), ...]
           for name, t in export.items() if _part_of(name) is None}
    for part in {p for name in export if (p := _part_of(name)) is not None}:
        where = {r: i for i, r in enumerate(export[f"{part}_rows"].tolist())}  # position -> entry of the part
        keep = [(j, where[p]) for j, p in enumerate(positions) if p in where]
        out[f"{part}_rows"] = torch.tensor([j for j, _ in keep], dtype=torch.long)
        entries = torch.tensor([i for _, i in keep], dtype=torch.long)
        for name, t in export.items():
            if _part_of(name) == part and not name.endswith("_rows"):
                out[name] = t.index_select(1, entries.to(t.device))  # [dim0, len(keep), ...]
    return out


def _part_of(name: str) -> str | None:
    """The part of `_PARTS` an export tensor belongs to (``"sink"`` for ``"sink_rows"`` and ``"3.sink_keys"``)."""
    if name.endswith("_rows"):
        return name[: -len("_rows")] if name[: -len("_rows")] in _PARTS else None
    tail = name.split(".", 1)[1] if "." in name else ""
    return next((p for p in _PARTS if tail.startswith(p + "_")), None)
