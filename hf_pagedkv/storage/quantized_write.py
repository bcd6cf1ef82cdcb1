"""The write path of `QuantizedPageStore`: route a step's new tokens to stages, or encode the blocks they fill."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_pagedkv.storage.codecs import check_finite


@dataclass
class WritePlan:
    """Where one forward step's new tokens go, as index tensors on one device; built once per step by
    `QuantizedPageStore.plan_write` and used by every layer. Token positions index the step's new tokens row-major
    (`[rows * num_new_tokens]`), as the slot mapping does."""

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


class QuantizedWriteMixin:
    """Mixed into `QuantizedPageStore` (see its docstring for the block states). A step's tokens go like this for
    block size 4, a row holding 6 tokens that gets 3 more::

        before:  [ b0: encoded | b1: t4 t5 .  .  (open, stage s) ]
        write:                          t6 t7 | t8          t7 fills b1: encode [t4 t5 from s | t6 t7 new] once
        after:   [ b0: encoded | b1: encoded | b2: t8 . . . (open, new stage) ]
    """

    # -- write -----------------------------------------------------------------------------------------------------
    def plan_write(self, slots: torch.Tensor, device: torch.device, new_step: bool = True, start: int = 0,
                   num_new: int | None = None) -> WritePlan:
        """Route a step's new tokens: to stages, or into the blocks they complete. Updates block states once per
        step (call again with ``new_step=False`` for another device or after the step's rows changed).

        Args:
            slots (`torch.LongTensor` of shape `[rows * num_new_tokens]`, CPU): the slot mapping, row-major.
            device (`torch.device`): where the plan's index tensors go.
            new_step (`bool`): the first plan of a forward step (releases the stages of last step's encoded blocks).
            start (`int`): position of each row's first new token (tokens the rows held before the step).
            num_new (`int`, *optional*): new tokens per row (defaults to all of `slots`: one row).
        """
        num_new = num_new or len(slots)
        B = self.block_size
        if new_step:
            self._release_pending()
            self._encoded_in_step.clear()
        blk, off = slots // B, slots % B  # [n] each
        ublk, inv = torch.unique(blk, return_inverse=True)  # touched blocks, and each token's index among them
        first_off = torch.full((len(ublk),), B, dtype=torch.long).scatter_reduce_(0, inv, off, "amin")
        complete = torch.zeros(len(ublk), dtype=torch.bool)
        complete[inv[off == B - 1]] = True  # a write to the last slot fills the block
        done, prefix, recode, opens = [], [], [], []
        for b, is_done, first in zip(ublk.tolist(), complete.tolist(), first_off.tolist()):
            stage = self._stage_of.get(b)
            if is_done:
                if first > 0 and stage is not None:
                    prefix.append((len(done), stage))
                elif first > 0:
                    assert self._encoded[b], f"block {b} is written from offset {first} but holds no earlier tokens"
                    recode.append((len(done), b))
                if stage is not None:
                    self._pending.add(b)
                if b not in self._encoded_in_step:
                    if self._encoded[b] and first > 0:  # reopened by a crop, refilled at once: a fresh count
                        self._num_encodes[b] = 0
                    self._num_encodes[b] = min(255, self._num_encodes[b] + 1)  # 2: a fault (invariant 4)
                    self._encoded_in_step.add(b)
                self._encoded[b] = 1
                done.append(b)
                continue
            if stage is None:
                stage = self._stage_of[b] = self.staging.allocate()
                if self._encoded[b]:
                    opens.append((b, stage, first))
            elif self._encoded[b]:  # an encoded block still holding its stage, cropped and written again
                opens.append((b, stage, first))
                self._pending.discard(b)
            self._encoded[b] = self._num_encodes[b] = 0  # open: written into a stage, encoded when it fills
        if opens:
            self._reopen(opens)
        n = len(slots)
        sink_src, sink_dst = self._plan_sinks(slots, start, num_new) if start < self.sink_tokens else ([], [])
        tok_done = complete[inv]  # [n] tokens that land in a completed block
        rank = torch.full((len(ublk),), -1, dtype=torch.long)
        rank[complete] = torch.arange(len(done))
        done_src = tok_done.nonzero().squeeze(1)
        done_dst = rank[inv[done_src]] * B + off[done_src]
        direct = len(done_src) == n and torch.equal(done_dst, torch.arange(n))
        stage_src = (~tok_done).nonzero().squeeze(1)
        stage_ids = torch.tensor([self._stage_of.get(b, -1) for b in ublk.tolist()], dtype=torch.long)
        stage_dst = stage_ids[inv[stage_src]] * B + off[stage_src]

        def dev(x):
            return torch.tensor(x, dtype=torch.long, device=device) if isinstance(x, list) else x.to(device)

        return WritePlan(
            stage_src=None if len(stage_src) == n else dev(stage_src), stage_dst=dev(stage_dst),
            done_blocks=dev(done), done_src=None if direct else dev(done_src), done_dst=dev(done_dst),
            prefix_rank=dev([r for r, _ in prefix]), prefix_stage=dev([s for _, s in prefix]),
            recode_rank=dev([r for r, _ in recode]), recode_blocks=dev([b for _, b in recode]),
            sink_src=dev(sink_src), sink_dst=dev(sink_dst))

    def _plan_sinks(self, slots: torch.Tensor, start: int, q: int) -> tuple[list[int], list[int]]:
        """(token indices, sink slots) of the new tokens at positions < `sink_tokens`, giving each first block that
        lacks one a sink stage. Token `i` of the row-major slot mapping is at position ``start + i % q``."""
        B, S = self.block_size, self.sink_tokens
        idx = torch.arange(len(slots)).view(-1, q)[:, : S - start].reshape(-1)  # [rows * (S - start)]
        src, dst = idx.tolist(), []
        for slot in slots[idx].tolist():
            block = slot // B
            if block not in self._sink_of:
                self._sink_of[block] = self.sinks.allocate()
            dst.append(self._sink_of[block] * S + slot % B)
        return src, dst

    def write(self, layer_idx: int, plan: WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one layer's new tokens as `plan` says: encode the blocks they complete, stage the rest.

        Args:
            plan (`WritePlan`): from `plan_write` for this step and device.
            key_states, value_states (`torch.Tensor` of shape `[rows, num_kv_heads, num_new_tokens, head_dim]`).

        Raises:
            ValueError: NaN or inf in a quantized half (nothing of this layer was written).
        """
        B = self.block_size
        flats = []
        for half, new in enumerate((key_states, value_states)):
            flat = new.transpose(0, 1).reshape(new.shape[1], -1, new.shape[-1])  # [num_kv_heads, rows * q, dim]
            # NOTE: a sum is NaN/inf iff an element is (barring overflow, then the exact check decides): one op
            if self.codecs[half].bits is not None and not math.isfinite(float(flat.sum())):
                check_finite(flat, f"{('key', 'value')[half]}_states of layer {layer_idx}")
            flats.append(flat)
        c = len(plan.done_blocks)
        for half, (flat, store) in enumerate(zip(flats, (self.staging.keys, self.staging.values))):
            heads, dim = flat.shape[0], flat.shape[-1]
            if c:
                if plan.done_src is None:  # the new tokens are exactly the completed blocks, in order (a prefill)
                    buf = flat.view(heads, c, B, dim)
                else:
                    buf = flat.new_empty((heads, c, B, dim))  # [num_kv_heads, c, block_size, dim]
                    if len(plan.prefix_rank):  # earlier tokens from the blocks' stages
                        stages = self.staging.blocks(store, layer_idx).index_select(1, plan.prefix_stage)
                        buf.index_copy_(1, plan.prefix_rank, stages)
                    if len(plan.recode_rank):  # earlier tokens of a block reopened by a crop, from its codes
                        tmp = flat.new_empty((heads, len(plan.recode_rank), B, dim))
                        buf.index_copy_(1, plan.recode_rank, self._decode_blocks(layer_idx, half, plan.recode_blocks,
                                                                                 tmp))
                    buf.view(heads, c * B, dim).index_copy_(1, plan.done_dst, flat.index_select(1, plan.done_src))
                codes, scales = self.codecs[half].encode(buf)  # [num_kv_heads, c, code_size], [.., scale_size]
                self.codes[layer_idx][half].index_copy_(1, plan.done_blocks, codes)
                self.scales[layer_idx][half].index_copy_(1, plan.done_blocks, scales)
            if len(plan.stage_dst):
                src = flat if plan.stage_src is None else flat.index_select(1, plan.stage_src)
                store[layer_idx].index_copy_(1, plan.stage_dst, src.to(store[layer_idx].dtype))
            if len(plan.sink_dst):  # the sink tokens, also in full precision
                sink = (self.sinks.keys, self.sinks.values)[half][layer_idx]
                sink.index_copy_(1, plan.sink_dst, flat.index_select(1, plan.sink_src).to(sink.dtype))
