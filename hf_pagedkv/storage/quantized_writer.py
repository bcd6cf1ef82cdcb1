"""`QuantizedWriter`: the write path of a quantized store: stage new tokens, encode the blocks they complete."""

from __future__ import annotations

import math

import torch

from hf_pagedkv.storage.codecs import check_finite
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.quantized_block_states import QuantizedBlockStates
from hf_pagedkv.storage.quantized_reader import QuantizedReader
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor
from hf_pagedkv.storage.staging_store import StagingStore
from hf_pagedkv.storage.write_plan import WritePlan


class QuantizedWriter:
    """Writes a step's new tokens into a `QuantizedPageStore`: `prepare_write` routes them once per step and
    device (`QuantizedBlockStates.plan`, a `WritePlan`), `write` then stages each layer's tokens in full precision and
    encodes the blocks they complete, once (invariant 4).

    A crop into an encoded block reopens it: `prepare_write` decodes its kept tokens into its new stage (through the
    `reader`), poisoning the rest in debug mode. Keys and values must be finite to be quantized: on the CPU `write`
    checks before writing; on an accelerator it keeps one finiteness flag per layer and half (`_finite_flags`) and
    the next step's `prepare_write` reads them all at once, so no layer waits for the device.

    Args:
        block_size (`int`): tokens per block.
        codecs (`tuple`): the key and the value codec.
        specs (`dict[int, LayerSpec]`): each layer's spec (the store's; read only).
        codes, scales (`dict[int, list[SegmentedTensor]]`): each layer's `[key, value]` codes and scales, written here.
        states (`QuantizedBlockStates`): the block states, updated by `prepare_write` and `write`.
        staging, sinks (`StagingStore`): the stages of open blocks and the sink stages, written here.
        reader (`QuantizedReader`): decodes the kept tokens of reopened blocks.
    """

    def __init__(self, block_size: int, codecs: tuple, specs: dict[int, LayerSpec],
                 codes: dict[int, list[SegmentedTensor]], scales: dict[int, list[SegmentedTensor]],
                 states: QuantizedBlockStates, staging: StagingStore, sinks: StagingStore,
                 reader: QuantizedReader) -> None:
        self.block_size, self.codecs = block_size, codecs  # fixed
        self.specs, self.codes, self.scales = specs, codes, scales  # the store's; codes and scales written here
        self.states, self.staging, self.sinks, self.reader = states, staging, sinks, reader  # the store's
        # accelerators: per-layer finiteness flags of this step's quantized halves, checked at the next step's start
        # (reading a flag on the host would wait for the device at every layer)
        self._finite_flags: list[tuple[int, int, torch.Tensor]] = []

    def _reopen(self, opens: list[tuple[int, int, int]]) -> None:
        """Decode encoded blocks into their new stages, in every layer: `(block, stage, first new offset)`."""
        for idx in self.specs:
            for half, store in enumerate((self.staging.keys, self.staging.values)):
                for b, stage, first in opens:
                    out = self.staging.block(store, idx, stage).unsqueeze(1)  # [num_kv_heads, 1, block_size, dim]
                    self.reader.decode_blocks(idx, half, torch.tensor([b]), out)
                    if self.staging.debug:
                        out[:, :, first:] = float("nan")

    # -- what `QuantizedPageStore.prepare_write` / `write` do ------------------------------------------------------
    def prepare_write(self, slots: torch.Tensor, device: torch.device, *, new_step: bool = True, start: int = 0,
                      num_new: int | None = None, positions: torch.Tensor | None = None) -> WritePlan:
        """The `WritePlan` of a step's tokens for every layer on `device`: which tokens go to stages and which
        blocks they complete (encoded by `write`, once). Updates the block states once per step (call again with
        ``new_step=False`` for another device or after the step's rows changed). The arguments are those of
        `QuantizedBlockStates.plan` (`slots`: the `[rows * num_new_tokens]` slot mapping, row-major, on the CPU);
        encoded blocks a crop cut into are decoded into their new stages here.

        Raises:
            ValueError: (accelerators, at a new step) the previous step wrote NaN or inf K/V into a quantized half;
                the blocks it encoded hold NaN scales, so release the cache.
        """
        if new_step and self._finite_flags:
            flags, self._finite_flags = self._finite_flags, []
            finite = torch.stack([f.to(flags[0][2].device) for _, _, f in flags]).tolist()  # one wait per step
            bad = [(layer, half) for (layer, half, _), ok in zip(flags, finite) if not ok]
            if bad:
                layer, half = bad[0]
                raise ValueError(f"Cannot quantize {('key', 'value')[half]}_states of layer {layer}: the previous "
                                 "step wrote NaN or inf into a quantized pool (its encoded blocks hold NaN). Quantized "
                                 "KV storage needs finite keys/values (check the model's dtype for overflow, or use "
                                 "quant=None); release this cache.")
        plan, opens = self.states.plan(slots, device, new_step=new_step, start=start, num_new=num_new,
                                       positions=positions, num_layers=len(self.specs))
        if opens:
            self._reopen(opens)
        return plan

    def write(self, layer_idx: int, plan: WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one layer's new tokens as `plan` says: encode the blocks they complete, stage the rest.

        Args:
            plan (`WritePlan`): from `prepare_write` for this step and device.
            key_states, value_states (`torch.Tensor` of shape `[rows, num_kv_heads, num_new_tokens, head_dim]`).

        Raises:
            ValueError: NaN or inf in a quantized half, on the CPU (nothing of this layer was written). On an
                accelerator the check is deferred to the next step's `prepare_write`, so that no layer waits for
                the device.
        """
        B = self.block_size
        flats = []
        for half, new in enumerate((key_states, value_states)):
            flat = new.transpose(0, 1).reshape(new.shape[1], -1, new.shape[-1])  # [num_kv_heads, rows * q, dim]
            if self.codecs[half].bits is not None:
                # NOTE: a sum is NaN/inf iff an element is (barring overflow, then the exact check decides): one op
                total = flat.sum()
                if not flat.is_cpu:
                    self._finite_flags.append((layer_idx, half, torch.isfinite(total)))
                elif not math.isfinite(float(total)):
                    check_finite(flat, f"{('key', 'value')[half]}_states of layer {layer_idx}")
            flats.append(flat)
        # (`shape[0]`, not `len()`: a tensor's `__len__` is a Python call; this runs per layer and step)
        c, staged, sunk = plan.done_blocks.shape[0], plan.stage_dst.shape[0], plan.sink_dst.shape[0]
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
                        kept = self.reader.decode_blocks(layer_idx, half, plan.recode_blocks, tmp)
                        buf.index_copy_(1, plan.recode_rank, kept)
                    buf.view(heads, c * B, dim).index_copy_(1, plan.done_dst, flat.index_select(1, plan.done_src))
                codes, scales = self.codecs[half].encode(buf)  # [num_kv_heads, c, code_size], [.., scale_size]
                self.codes[layer_idx][half].index_copy_(1, plan.done_blocks, codes)
                self.scales[layer_idx][half].index_copy_(1, plan.done_blocks, scales)
            if staged:
                src, dst = flat if plan.stage_src is None else flat.index_select(1, plan.stage_src), store[layer_idx]
                dst.index_copy_(1, plan.stage_dst, src if src.dtype == dst.dtype else src.to(dst.dtype))
            if sunk:  # the sink tokens, also in full precision
                sink = (self.sinks.keys, self.sinks.values)[half][layer_idx]
                sink.index_copy_(1, plan.sink_dst, flat.index_select(1, plan.sink_src).to(sink.dtype))
        if c:
            self.states.note_encoded(plan.done_ids, layer_idx)
