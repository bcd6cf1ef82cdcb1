"""`HostStore`: preallocated host-memory copies of whole KV blocks (the storage half of the host tier)."""

from __future__ import annotations

import torch


class HostStore:
    """Whole blocks of one layer group in host (CPU) memory, in the format the device store's `export_blocks` gives.

    Layout: every exported tensor (one entry per block along dim 1; for a full-precision store ``"{layer}.keys"``
    `[num_kv_heads, n, block_size, key_dim]` and ``"{layer}.values"``) gets one preallocated tensor
    ``[num_kv_heads, num_blocks, block_size, dim]`` in the model dtype, in pinned memory when the device tier is
    CUDA (page-locked memory is what lets a copy run at full PCIe bandwidth and overlap compute). Host block `h`
    is index `h` along dim 1 of each. The storage is allocated once, at the first `write`, from the shapes of that
    export; `num_blocks` is fixed at construction. Holds no bookkeeping: which ids are free is `HostTier`'s.
    """

    def __init__(self, num_blocks: int, pin_memory: bool) -> None:
        self.num_blocks = num_blocks  # capacity in blocks; fixed
        self.pin_memory = pin_memory  # pinned host memory (the device tier is CUDA); fixed
        self.tensors: dict[str, torch.Tensor] = {}  # export name -> [dim0, num_blocks, ...] on the CPU; set once

    @property
    def bytes_reserved(self) -> int:
        """Bytes of host memory allocated (0 before the first write)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.inference_mode(False)  # storage outlives the call (see PageStore._new)
    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.tensors[name] = torch.empty((t.shape[0], self.num_blocks, *t.shape[2:]), dtype=t.dtype,
                                             pin_memory=self.pin_memory)

    def write(self, host_blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Copy an export of `len(host_blocks)` device blocks into host blocks `host_blocks`, synchronously (the
        device blocks may be reused as soon as this returns).

        Raises:
            ValueError: `tensors` does not have the names and per-block shapes of the first write (another format).
        """
        if not self.tensors:
            self._allocate(tensors)
        if set(tensors) != set(self.tensors) or any(
                tuple(t.shape[:1] + t.shape[2:]) != tuple(self.tensors[k].shape[:1] + self.tensors[k].shape[2:])
                or t.shape[1] != len(host_blocks) for k, t in tensors.items()):
            raise ValueError("HostStore.write: the export does not match this host store's layout.")
        idx = torch.tensor(host_blocks, dtype=torch.long)
        for name, t in self.tensors.items():
            t.index_copy_(1, idx, tensors[name].to("cpu"))  # [dim0, n, ...] into [dim0, num_blocks, ...]

    def read(self, host_blocks: list[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The export of host blocks `host_blocks`, as the device store's `import_blocks` takes it, on `device`:
        ``name -> [dim0, len(host_blocks), ...]``."""
        idx = torch.tensor(host_blocks, dtype=torch.long)
        out = {}
        for name, t in self.tensors.items():
            picked = t.index_select(1, idx)  # [dim0, n, ...] on the CPU
            if self.pin_memory:
                picked = picked.pin_memory()
            out[name] = picked.to(device, non_blocking=self.pin_memory)
        return out
