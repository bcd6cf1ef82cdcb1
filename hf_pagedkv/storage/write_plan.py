"""`WritePlan`: where one forward step's new tokens go in a quantized store (the quantized write target)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WritePlan:
    """Where one forward step's new tokens go, as index tensors on one device; built once per step and device by
    `QuantizedPageStore.prepare_write` and used by every layer. Token positions index the step's new tokens
    row-major (`[rows * num_new_tokens]`), as the slot mapping does."""

    stage_src: torch.Tensor | None  # [n_s] new tokens written into stages (None: all of them, in order)
    stage_dst: torch.Tensor  # [n_s] their staging slots (stage * block_size + offset)
    done_blocks: torch.Tensor  # [c] blocks this write completes: encoded now, once
    done_src: torch.Tensor | None  # [n_d] new tokens of completed blocks (None: all tokens, exactly those blocks)
    done_dst: torch.Tensor  # [n_d] their positions in the `[c * block_size]` encode buffer
    prefix_rank: torch.Tensor  # [p] completed blocks (index into done_blocks) whose earlier tokens are staged
    prefix_stage: torch.Tensor  # [p] those stages
    recode_rank: torch.Tensor  # [r] completed blocks whose earlier tokens are encoded (reopened by a crop)
    recode_blocks: torch.Tensor  # [r] those blocks
    sink_src: torch.Tensor  # [k] new tokens at positions < sink_tokens (the sink, also kept in full precision)
    sink_dst: torch.Tensor  # [k] their sink slots (sink stage * sink_tokens + position)
    done_ids: tuple[int, ...] = ()  # `done_blocks` as ints (the store notes which layers encoded them)


__all__ = ["WritePlan"]
