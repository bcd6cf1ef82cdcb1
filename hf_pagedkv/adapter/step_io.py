"""`StepIO`: one cache's writes and reads of one layer group in its current forward step, for a caller that writes
the K/V of many caches in one store call (the serving engine's packed step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_pagedkv.adapter.step_plan import StepPlan


@dataclass(frozen=True)
class StepIO:
    """What every layer of one layer group writes and reads in one cache's current step, computed once for all of
    them (`StepRunner.step_io`): the caller writes the step's new K/V to `slots` itself (with other caches' tokens,
    one `store.write` per layer), then calls `written` and `read` for each layer, in place of `PagedLayer.update`.
    The same K/V land in the same slots and the same history is read, so the result equals `update`'s.

    Only for a step of one row, every token stored, no duplicate rows, a full-precision store and no retention
    policy (`of` returns None otherwise). Valid until the step ends (the next step's first layer plans anew).
    """

    start: int  # tokens the cache held before the step
    end: int  # tokens it holds after it
    lo: int  # first token this group's layers read (0; for a sliding window the window's first)
    slots: torch.Tensor  # `[end - start]` int64 on the layers' device: the slot of each new token, in order
    store: object  # the group's full-precision `PageStore` (`write`, `read_view`)
    view_start: int | None  # slot of token `lo` when the row's blocks are consecutive (read as a view), else None
    read_layer: Callable[[object, int], tuple[torch.Tensor, torch.Tensor]]  # `StepRunner.read_layer` (a gather)

    @staticmethod
    def of(plan: StepPlan | None, tensors, rows, group, layer, num_tokens: int, retention: bool,
           read_layer) -> StepIO | None:
        """The `StepIO` of `layer` (a `PagedLayer` of group `group`, a `BlockGroup`) in step `plan` with index
        tensors `tensors` (`StepTensors`), or None when the step does not qualify (see the class docstring) or
        `layer` is not at its start (not planned yet, or written already): the caller then calls `update`.
        `num_tokens`: the rows' tokens; `retention`: whether the cache has a retention policy."""
        if (plan is None or plan.num_rows != 1 or plan.dup_of or not plan.stores_every_token or retention
                or group.is_quantized or layer.num_tokens != plan.start or plan.end != num_tokens):
            return None
        rt = rows.by_group[layer.group]
        base, lo = plan.view_base.get(rt.group), rt.window_start(plan.start)
        return StepIO(plan.start, plan.end, lo, tensors.write_target(rt, group, layer.spec.device),
                      group.page_store, None if base is None else base + lo, read_layer)

    def written(self, layer) -> None:
        """`layer` (a `PagedLayer`) now holds the step's tokens: call after the caller wrote them to `slots`.

        Raises:
            RuntimeError: `layer` is not at the step's start (it was written already, or the step was interrupted).
        """
        if layer.num_tokens != self.start:
            raise RuntimeError(f"Layer {layer.layer_idx} holds {layer.num_tokens} tokens, not the {self.start} of "
                               "the step being written: an earlier error interrupted a forward step.")
        layer.num_tokens = self.end

    def read(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """What `layer`'s attention reads after `written`: keys, values `[1, num_kv_heads, end - lo, head_dim]`
        (views when the row's blocks are consecutive in one storage segment, else gathered)."""
        if self.view_start is not None:
            return self.store.read_view(layer.layer_idx, self.view_start, self.end - self.lo)
        return self.read_layer(layer, self.lo)


__all__ = ["StepIO"]
