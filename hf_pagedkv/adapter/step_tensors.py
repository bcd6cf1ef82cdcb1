"""`StepTensors`: the index tensors of one `StepPlan`, built once per layer group and device, shared by its layers."""

from __future__ import annotations

import torch

from hf_pagedkv.adapter.row_tables import RowTables
from hf_pagedkv.adapter.step_plan import StepPlan


class StepTensors:
    """Lazily built index tensors of one step plan: the writer rows, the slot mapping, the slots each layer group
    reads, and each group's store write target (what `store.prepare_write` returns), per device.

    Args:
        plan (`StepPlan`): the step.
        prepared (`set[int]`, *optional*): groups whose store has already prepared a write in this step (a plan
            replaced mid-step by `StepPlan.with_writer` keeps them, so a quantized store does not start the step
            twice).
    """

    def __init__(self, plan: StepPlan, prepared: set[int] | None = None) -> None:
        self.plan = plan  # fixed
        self.prepared: set[int] = set(prepared or ())  # groups whose store saw `prepare_write(new_step=True)`
        self._tensors: dict[tuple, object] = {}  # (group, kind, device) -> tensor or write target

    def writer_rows(self, device: torch.device) -> torch.Tensor:
        """`[len(writers)]` int64: the rows whose K/V are written."""
        key = (None, "writers", device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(self.plan.writers, dtype=torch.long, device=device)
        return self._tensors[key]

    def stored_tokens(self, device: torch.device) -> torch.Tensor | None:
        """`[n]` int64: which of the writers' row-major `[len(writers) * num_new]` new tokens are stored, when some
        are not (they lie in whole blocks of left padding, which name the pad block: `StepPlan.pad_skip`); None when
        every one is."""
        plan = self.plan
        if plan.stores_every_token:
            return None
        key = (None, "stored", device)
        if key not in self._tensors:
            keep = torch.ones((len(plan.writers), plan.num_new), dtype=torch.bool)  # [writers, num_new]
            for i, r in enumerate(plan.writers):
                lo, hi = plan.pad_skip[r]
                keep[i, lo:hi] = False
            self._tensors[key] = keep.reshape(-1).nonzero().reshape(-1).to(device)  # [n]
        return self._tensors[key]

    def indices(self, rt: RowTables, kind: str, device: torch.device) -> torch.Tensor:
        """One group's index tensors on `device`: ``"write"``, the slot mapping of the writers' new tokens,
        row-major `[len(writers) * num_new]` (only the `stored_tokens`, `[n]`, when some are not stored);
        ``"read"``, the block ids of the positions its layers read (from the window start's block), `[batch, n]`."""
        key = (rt.group, kind, device)
        t = self._tensors.get(key)
        if t is None:
            plan = self.plan
            base = plan.view_base.get(rt.group)
            stored = self.stored_tokens(torch.device("cpu")) if kind == "write" else None
            if stored is not None:  # NOTE: never the consecutive slots of a view base: they include the pad block's
                t = rt.write_slots(list(plan.writers), plan.start, plan.end)[stored]  # [n]
            elif kind == "write" and base is not None:
                t = torch.arange(plan.start, plan.end) + base  # consecutive slots
            elif kind == "write":
                t = rt.write_slots(list(plan.writers), plan.start, plan.end)
            else:
                t = rt.table[:, rt.window_start(plan.start) // rt.block_size: -(-plan.end // rt.block_size)]
            t = t.to(device)
            self._tensors[key] = t
        return t

    def write_target(self, rt: RowTables, store, device: torch.device):
        """What `store.write` takes for this step's tokens of group `rt` on `device`, prepared once (the first
        preparation of a group in a step starts the step in its store)."""
        key = (rt.group, "target", device)
        if key not in self._tensors:
            slots = self.indices(rt, "write", torch.device("cpu"))
            stored = self.stored_tokens(torch.device("cpu"))  # [n], or None: every token
            positions = None if stored is None else self.plan.start + stored % self.plan.num_new  # [n]
            self._tensors[key] = store.prepare_write(slots, device, new_step=rt.group not in self.prepared,
                                                     start=self.plan.start, num_new=self.plan.num_new,
                                                     positions=positions)
            self.prepared.add(rt.group)
        return self._tensors[key]


__all__ = ["StepTensors"]
