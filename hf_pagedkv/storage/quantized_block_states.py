"""`QuantizedBlockStates`: which blocks of a quantized store are fresh, open (staged) or encoded, and their stages."""

from __future__ import annotations

import torch

from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.storage.staging_store import StagingStore
from hf_pagedkv.storage.write_plan import WritePlan


class QuantizedBlockStates:
    """The block-state bookkeeping of a `QuantizedPageStore` (the tensors stay in the store). Each block is in one
    state:

    - *fresh*: just allocated (or free), no stage, not encoded;
    - *open*: ``stage_of[b]`` names its stage; the partial last block of a sequence, written token by token;
    - *encoded*: its codes hold it. A block is encoded once, by the write that fills its last slot, and then read
      by decoding. A block encoded in the current step keeps its stage until a later step starts after every layer
      of the store wrote it (`pending`, `layers_written`): the step's later layers encode it from that stage, and a
      mid-step unshare may still need its first tokens. NOTE: "after every layer wrote it", not "at the next step":
      caches sharing the pool may interleave their steps layer by layer (a packed serving step writes request after
      request in each layer), so another cache's step may start while this one's later layers still read the stage.

    A step's tokens go like this for block size 4, a row holding 6 tokens that gets 3 more::

        before:  [ b0: encoded | b1: t4 t5 .  .  (open, stage s) ]
        write:                          t6 t7 | t8          t7 fills b1: encode [t4 t5 from s | t6 t7 new] once
        after:   [ b0: encoded | b1: encoded | b2: t8 . . . (open, new stage) ]

    Args:
        block_size (`int`): tokens per block.
        sink_tokens (`int`): leading tokens of each sequence also kept in full precision (0: none).
        staging, sinks (`StagingStore`): the stages of open blocks and the sink stages; this object allocates and
            frees them.
    """

    def __init__(self, block_size: int, sink_tokens: int, staging: StagingStore, sinks: StagingStore) -> None:
        self.block_size = block_size  # fixed
        self.sink_tokens = sink_tokens  # fixed
        self.staging, self.sinks = staging, sinks  # fixed
        self.stage_of: dict[int, int] = {}  # block -> its stage (open blocks, and pending ones)
        self.sink_of: dict[int, int] = {}  # first block of a sequence -> its sink stage
        self.encoded = bytearray()  # encoded[b] == 1 iff block b's codes hold it
        self.pending: set[int] = set()  # blocks encoded in the current step that still hold a stage
        # num_encodes[b]: steps that encoded block b since it was last freed or (re)opened (1 when encoded, else 0;
        # 2 or more breaks invariant 4). A step counts once: every layer encodes the block once in that step.
        self.num_encodes = bytearray()
        # blocks encoded by the current step: a second plan of the step (another device, or after an unshare)
        # encodes them for the remaining layers, not again
        self.encoded_in_step: set[int] = set()
        # block of `encoded_in_step` -> the layers whose write encoded it so far (`note_encoded`); its step is over,
        # for this block, once every layer of the store is in it
        self.layers_written: dict[int, set[int]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.encoded)

    def grow(self, num_blocks: int) -> None:
        """Track `num_blocks` blocks (new ones fresh)."""
        self.encoded.extend(bytes(num_blocks - len(self.encoded)))
        self.num_encodes.extend(bytes(num_blocks - len(self.num_encodes)))

    def shrink(self, num_blocks: int) -> None:
        """Track only blocks ``< num_blocks`` (the store dropped the others' storage; none holds a stage)."""
        assert not any(b >= num_blocks for b in (*self.stage_of, *self.sink_of)), "shrink of held blocks"
        del self.encoded[num_blocks:], self.num_encodes[num_blocks:]

    def plan(self, slots: torch.Tensor, device: torch.device, new_step: bool = True, start: int = 0,
             num_new: int | None = None, positions: torch.Tensor | None = None,
             num_layers: int | None = None) -> tuple[WritePlan, list[tuple[int, int, int]]]:
        """Route a step's new tokens: to stages, or into the blocks they complete, updating the block states once
        per step (call again with ``new_step=False`` for another device or after the step's rows changed).

        Args:
            slots (`torch.LongTensor` of shape `[rows * num_new_tokens]`, CPU): the slot mapping, row-major.
            device (`torch.device`): where the plan's index tensors go.
            new_step (`bool`): the first plan of a forward step (releases the stages of earlier steps' encoded
                blocks that every layer has written).
            start (`int`): position of each row's first new token (tokens the rows held before the step).
            num_new (`int`, *optional*): new tokens per row (defaults to all of `slots`: one row).
            positions (`torch.LongTensor` of shape `[len(slots)]`, *optional*, CPU): each token's position in its
                row, when the step stores only some of its tokens (a row's whole blocks of padding name the pad
                block and are not written); by default ``start + i % num_new`` for token `i`.
            num_layers (`int`, *optional*): layers of the store; an earlier step's encoded block is done once this
                many layers wrote it (`note_encoded`). None: at the next step, whatever wrote it.

        Returns:
            The `WritePlan`, and the encoded blocks this write reopens (a crop cut into them): `(block, stage,
            first new offset)` each, whose kept tokens the store must decode into their new stage.
        """
        num_new = num_new or len(slots)
        B = self.block_size
        if new_step:
            self._end_steps(num_layers)
        blk, off = slots // B, slots % B  # [n] each
        ublk, inv = torch.unique(blk, return_inverse=True)  # touched blocks, and each token's index among them
        first_off = torch.full((len(ublk),), B, dtype=torch.long).scatter_reduce_(0, inv, off, "amin")
        complete = torch.zeros(len(ublk), dtype=torch.bool)
        complete[inv[off == B - 1]] = True  # a write to the last slot fills the block
        self.check_stages(sum(1 for b, is_done in zip(ublk.tolist(), complete.tolist())
                               if not is_done and b not in self.stage_of))
        done, prefix, recode, opens = [], [], [], []
        for b, is_done, first in zip(ublk.tolist(), complete.tolist(), first_off.tolist()):
            stage = self.stage_of.get(b)
            if is_done:
                if first > 0 and stage is not None:
                    prefix.append((len(done), stage))
                elif first > 0:
                    assert self.encoded[b], f"block {b} is written from offset {first} but holds no earlier tokens"
                    recode.append((len(done), b))
                if stage is not None:
                    self.pending.add(b)
                if b not in self.encoded_in_step:
                    if self.encoded[b] and first > 0:  # reopened by a crop, refilled at once: a fresh count
                        self.num_encodes[b] = 0
                    self.num_encodes[b] = min(255, self.num_encodes[b] + 1)  # 2: a fault (invariant 4)
                    self.encoded_in_step.add(b)
                self.encoded[b] = 1
                done.append(b)
                continue
            if stage is None:
                stage = self.stage_of[b] = self.staging.allocate()
                if self.encoded[b]:
                    opens.append((b, stage, first))
            elif self.encoded[b]:  # an encoded block still holding its stage, cropped and written again
                opens.append((b, stage, first))
                self.pending.discard(b)
            self.encoded[b] = self.num_encodes[b] = 0  # open: written into a stage, encoded when it fills
        n = len(slots)
        sink_src, sink_dst = self._plan_sinks(slots, start, num_new, positions) if start < self.sink_tokens \
            else ([], [])
        tok_done = complete[inv]  # [n] tokens that land in a completed block
        rank = torch.full((len(ublk),), -1, dtype=torch.long)
        rank[complete] = torch.arange(len(done))
        done_src = tok_done.nonzero().squeeze(1)
        done_dst = rank[inv[done_src]] * B + off[done_src]
        direct = len(done_src) == n and torch.equal(done_dst, torch.arange(n))
        stage_src = (~tok_done).nonzero().squeeze(1)
        stage_ids = torch.tensor([self.stage_of.get(b, -1) for b in ublk.tolist()], dtype=torch.long)
        stage_dst = stage_ids[inv[stage_src]] * B + off[stage_src]

        def dev(x):
            return torch.tensor(x, dtype=torch.long, device=device) if isinstance(x, list) else x.to(device)

        plan = WritePlan(
            stage_src=None if len(stage_src) == n else dev(stage_src), stage_dst=dev(stage_dst),
            done_blocks=dev(done), done_src=None if direct else dev(done_src), done_dst=dev(done_dst),
            prefix_rank=dev([r for r, _ in prefix]), prefix_stage=dev([s for _, s in prefix]),
            recode_rank=dev([r for r, _ in recode]), recode_blocks=dev([b for _, b in recode]),
            sink_src=dev(sink_src), sink_dst=dev(sink_dst), done_ids=tuple(done))
        return plan, opens

    def check_stages(self, n: int) -> None:
        """Raise `PoolExhaustedError` (nothing changed) when the staging area cannot hand out `n` more stages."""
        free = self.staging.num_available()
        if free is not None and n > free:
            raise PoolExhaustedError(
                f"BlockPool is full: {counted(n, 'more full-precision stage')} needed, {free} of "
                f"{self.staging.capacity} free (a quantized pool holds each row's partial last block in full "
                "precision, inside its budget). Raise max_memory, run fewer rows at once, or release finished caches.")

    def num_freeable(self, num_layers: int | None) -> int:
        """Stages the next step's first `plan` returns before it allocates (blocks of earlier steps' encodes that
        every layer has written; see `_end_steps`)."""
        return sum(1 for b in self.pending if b in self.stage_of and (
            b not in self.encoded_in_step or num_layers is None or len(self.layers_written.get(b, ())) >= num_layers))

    def _plan_sinks(self, slots: torch.Tensor, start: int, q: int,
                    positions: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
        """(token indices, sink slots) of the new tokens at positions < `sink_tokens`, giving each first block that
        lacks one a sink stage. Token `i` of the row-major slot mapping is at position ``start + i % q`` (or
        ``positions[i]``)."""
        B, S = self.block_size, self.sink_tokens
        if positions is None:
            idx = torch.arange(len(slots)).view(-1, q)[:, : S - start].reshape(-1)  # [rows * (S - start)]
        else:
            idx = (positions < S).nonzero().reshape(-1)  # [tokens at positions < S]
        src, dst = idx.tolist(), []
        for slot in slots[idx].tolist():
            block = slot // B
            if block not in self.sink_of:
                self.sink_of[block] = self.sinks.allocate()
            dst.append(self.sink_of[block] * S + slot % B)
        return src, dst

    def mark_encoded(self, blocks: list[int]) -> None:
        """Fresh `blocks` whose codes the store filled directly (the pad block's zeros) count as encoded, once."""
        for b in blocks:
            assert b not in self.stage_of and b not in self.sink_of, f"mark_encoded of block {b}, which is open"
            self.encoded[b] = self.num_encodes[b] = 1

    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0 become fresh; their stages and sink stages are freed (all the bookkeeping
        first, then the debug-mode poisoning: an error in the latter leaves every state right)."""
        stages, sinks = [], []
        for b in blocks:
            stage = self.stage_of.pop(b, None)
            if stage is not None:
                self.staging.free(stage, poison=False)
                stages.append(stage)
            sink = self.sink_of.pop(b, None)
            if sink is not None:
                self.sinks.free(sink, poison=False)
                sinks.append(sink)
            self.encoded[b] = self.num_encodes[b] = 0
            self.pending.discard(b)
            self.encoded_in_step.discard(b)
            self.layers_written.pop(b, None)
        self.staging.poison(stages)
        self.sinks.poison(sinks)

    def copy(self, src: list[int], dst: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Blocks `dst[i]` (fresh) take the state of `src[i]` (copy-on-write), with new stages of their own.
        Returns the `(src stage, dst stage)` pairs of stages and of sink stages whose content the store copies."""
        self.check_stages(sum(1 for s in src if s in self.stage_of))
        stages, sinks = [], []
        for s, d in zip(src, dst):
            self.encoded[d], self.num_encodes[d] = self.encoded[s], self.num_encodes[s]
            if s in self.encoded_in_step:  # a mid-step copy (unshare): the step's re-plan encodes it, once
                self.encoded_in_step.add(d)
                self.layers_written[d] = set(self.layers_written.get(s, ()))
            if s in self.stage_of:
                self.stage_of[d] = self.staging.allocate()
                stages.append((self.stage_of[s], self.stage_of[d]))
            if s in self.sink_of:
                self.sink_of[d] = self.sinks.allocate()
                sinks.append((self.sink_of[s], self.sink_of[d]))
            if s in self.pending:
                self.pending.add(d)
        return stages, sinks

    def check(self, live: set[int]) -> list[tuple[int, str]]:
        """Problems given the `live` blocks (in use or cached-idle), each as (invariant number, text):

        4. a full block is encoded once: no block was encoded twice since it was last freed or reopened by a crop,
           and a block is in the encoded state iff one encode is counted for it;
        6. every stage and sink stage is owned by exactly one live block, and no stage is lost.
        """
        problems = []
        twice = [b for b, n in enumerate(self.num_encodes) if n > 1][:10]
        if twice:
            counts = [self.num_encodes[b] for b in twice]
            problems.append((4, f"blocks {twice} encoded {counts} times since they were last opened"))
        odd = [b for b in range(self.num_blocks) if self.encoded[b] != min(1, self.num_encodes[b])][:10]
        if odd:
            states, counts = [self.encoded[b] for b in odd], [self.num_encodes[b] for b in odd]
            problems.append((4, f"blocks {odd} in state encoded={states} with {counts} encodes counted"))
        for name, owner, area in (("stage", self.stage_of, self.staging), ("sink stage", self.sink_of, self.sinks)):
            dead = sorted(b for b in owner if b not in live)
            if dead:
                problems.append((6, f"{name}s held by free blocks {dead[:10]}"))
            distinct = len(set(owner.values()))
            if distinct != len(owner) or len(owner) != area.num_used:
                problems.append((6, f"{len(owner)} blocks own {distinct} distinct {name}s, {area.num_used} in use"))
        return problems

    def note_encoded(self, blocks, layer_idx: int) -> None:
        """Layer `layer_idx` wrote (encoded) `blocks`, the completed blocks of its step's `WritePlan`."""
        for b in blocks:
            self.layers_written.setdefault(b, set()).add(layer_idx)

    def _end_steps(self, num_layers: int | None) -> None:
        """A step begins: the blocks encoded by earlier steps that every layer wrote are done (their stages
        return); blocks some layer has still to write stay in their step (another cache's step interleaved).
        The bookkeeping comes first, then the debug-mode poisoning of the freed stages."""
        done = {b for b in self.encoded_in_step
                if num_layers is None or len(self.layers_written.get(b, ())) >= num_layers}
        stages = []
        for b in [b for b in self.pending if b in done or b not in self.encoded_in_step]:
            stage = self.stage_of.pop(b, None)
            if stage is not None:
                self.staging.free(stage, poison=False)
                stages.append(stage)
            self.pending.discard(b)
        self.encoded_in_step -= done
        for b in done:
            self.layers_written.pop(b, None)
        self.staging.poison(stages)


__all__ = ["QuantizedBlockStates"]
