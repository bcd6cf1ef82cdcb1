"""`QuantizedPageStore`: the K/V of a quantized pool, as codes + scales per block plus a full-precision staging area."""

from __future__ import annotations

import torch

from hf_pagedkv.config import QuantConfig
from hf_pagedkv.storage.block_storage import BlockStorage, BlockTensor, check_block_tensors
from hf_pagedkv.storage.code_layout import CodeLayout
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.code_table import CodeTable
from hf_pagedkv.storage.codecs import BlockLayout, codecs_for
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.quantized_block_states import QuantizedBlockStates
from hf_pagedkv.storage.quantized_reader import QuantizedReader
from hf_pagedkv.storage.quantized_writer import QuantizedWriter
from hf_pagedkv.storage.read_request import ReadRequest
from hf_pagedkv.storage.segmented_tensor import SegmentedTensor
from hf_pagedkv.storage.staging_store import StagingStore
from hf_pagedkv.storage.write_plan import WritePlan

_CODE_SENTINEL = 0xFF  # debug mode: freed code bytes (their scales become NaN, so a decode shows NaN)
# A fixed budget (`BlockPool(max_memory=...)`) splits its bytes between the full-precision stages of open blocks
# and encoded blocks so that each stage comes with `ROW_BLOCKS` encoded blocks (`budget_stages`): a row of
# (ROW_BLOCKS + 1) blocks then finds both; see `QuantizedPageStore.budget_split`
ROW_BLOCKS = 4
_MIN_BUDGET_STAGES = 2  # a row holds two stages in the step that completes its open block and opens the next
MAX_BUDGET_STAGES = 256  # 128 rows at once: a large budget's stages would mostly sit unused


def budget_stages(max_memory: int, stage_bytes: int, block_bytes: int) -> int:
    """Full-precision stages a quantized pool keeps inside a budget of `max_memory` bytes, each of `stage_bytes`
    (one block of every layer in the model dtype), the rest buying encoded blocks of `block_bytes` (every layer,
    with its sink stage): one stage per `ROW_BLOCKS` encoded blocks, so as many rows of ``(ROW_BLOCKS + 1) *
    block_size`` tokens find their stages as find their blocks (a row holds one stage, its partial last block, and
    encoded blocks before it). At least 2 and at most `MAX_BUDGET_STAGES`. An fp32 SmolLM2-135M at k8v4 (a stage
    4.3 blocks) gives stages about half of the budget; `hf-pagedkv plan` sizes budgets with the same rule."""
    rows = max_memory // (stage_bytes + ROW_BLOCKS * block_bytes)
    return max(_MIN_BUDGET_STAGES, min(MAX_BUDGET_STAGES, rows))


class QuantizedPageStore:
    """Preallocated quantized K/V storage for every layer of a pool (the `PageStore` of a `QuantConfig` pool).

    Layout, per layer, head-major so that a row whose blocks have consecutive ids reads its codes as a view::

        codes[layer]  = [key_codes, value_codes]:    [num_kv_heads, num_blocks, code_size]   uint8 (identity: dtype)
        scales[layer] = [key_scales, value_scales]:  [num_kv_heads, num_blocks, scale_size]  fp16

    each a `SegmentedTensor` held by a `BlockStorage` (`storage`): growth appends a segment of blocks
    (`segment_blocks`), copying nothing, and codes of consecutive blocks in one segment are read as views.

    where one block of one head is encoded by the layer's codec (`codecs/`, see `layouts`): keys per channel over the
    block's tokens, values per token in groups along head_dim (KIVI, arXiv 2402.02750). Blocks not encoded yet live in
    full precision in a `StagingStore`, sized by the number of sequences, not by the pool. `states`
    (`QuantizedBlockStates`) says which blocks are fresh, open (staged) or encoded; a block is encoded once, by the
    `write` that fills its last slot, and then read by decoding; it is never de-quantized and re-quantized.

    Sink: the first `quant.sink_tokens` tokens of each sequence (block 0 of its table, the same block for every
    sequence sharing it) are also written to a small full-precision `StagingStore` of `sink_tokens`-token stages
    (`states.sink_of[b]`), and reads take them from there instead of the decoded codes. A block keeps its sink stage
    until it is released; copies (copy-on-write) copy it.

    Crop into an encoded block leaves it encoded and readable; the next write into it *reopens* it (decodes its kept
    tokens into a new stage) and it is encoded again when it refills. That is the one case where tokens are quantized
    twice (error up to twice the codec's bound). The store sees a crop only through that write, which starts inside
    the encoded block: a write that starts at offset 0 of an encoded block is a fault (it would re-encode the block
    without a crop). `states.num_encodes` counts each block's encodes since it was last freed or (re)opened, so
    `check` can report a block encoded twice (invariant 4). Debug mode fills freed codes with 0xFF and their scales
    with NaN, and freed stages with NaN.

    The store owns the storage and the block lifecycle (grow, release, copy, export, import); a `QuantizedWriter`
    (`writer`) stages and encodes new tokens, a `QuantizedReader` (`reader`) reads them back in every form.
    """

    is_quantized = True

    def __init__(self, block_size: int, quant: QuantConfig, debug: bool = False) -> None:
        if quant.sink_tokens > block_size:
            raise ValueError(f"QuantConfig.sink_tokens={quant.sink_tokens} exceeds the block size {block_size}; "
                             "use at most one block of sink tokens (or a larger block_size).")
        self.block_size = block_size  # tokens per block; fixed
        self.quant = quant  # the storage format; fixed
        self.key_codec, self.value_codec = codecs_for(quant)  # keys per channel, values per token; fixed
        for codec in self.codecs:  # fail here, not at the first forward pass
            codec.check_block_size(block_size)
        self.staging = StagingStore(block_size, debug)  # full-precision stages of open blocks
        self.sink_tokens = quant.sink_tokens  # tokens per sink stage; fixed
        self.sinks = StagingStore(max(1, self.sink_tokens), debug)  # full-precision sink tokens of first blocks
        self.states = QuantizedBlockStates(block_size, self.sink_tokens, self.staging, self.sinks)  # block states
        self.storage = BlockStorage(debug)  # every layer's codes and scales by block: segments, copies, exports
        self.specs: dict[int, LayerSpec] = {}  # layer_idx -> spec; set once per layer by `add_layer`
        self.layouts: dict[int, tuple[BlockLayout, BlockLayout]] = {}  # layer_idx -> (key, value) block layouts
        self.codes: dict[int, list[SegmentedTensor]] = {}  # layer_idx -> [key_codes, value_codes]
        self.scales: dict[int, list[SegmentedTensor]] = {}  # layer_idx -> [key_scales, value_scales]
        self.reader = QuantizedReader(block_size, self.sink_tokens, self.codecs, self.specs, self.codes, self.scales,
                                      self.states, self.staging, self.sinks)  # the read paths
        self.writer = QuantizedWriter(block_size, self.codecs, self.specs, self.codes, self.scales, self.states,
                                      self.staging, self.sinks, self.reader)  # the write path

    @property
    def debug(self) -> bool:
        """Poison freed blocks, stages and new storage; set by the pool."""
        return self.storage.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self.storage.debug = self.staging.debug = self.sinks.debug = bool(value)

    @property
    def num_blocks(self) -> int:
        """Blocks allocated in every layer's tensors (changed by `grow` / `shrink` only)."""
        return self.storage.num_blocks

    @property
    def segment_blocks(self) -> list[int]:
        """Blocks of each storage segment, in id order; sums to `num_blocks`."""
        return self.storage.segment_blocks

    @property
    def codecs(self) -> tuple:
        return self.key_codec, self.value_codec

    # -- storage ---------------------------------------------------------------------------------------------------
    def block_layouts(self, spec: LayerSpec) -> tuple[BlockLayout, BlockLayout]:
        """Key and value layout of one block of one head (raises `ValueError` for dims the codecs cannot pack)."""
        return (self.key_codec.layout(self.block_size, spec.key_dim, spec.dtype),
                self.value_codec.layout(self.block_size, spec.value_dim, spec.dtype))

    def block_bytes(self, spec: LayerSpec) -> int:
        """Bytes of one encoded block of one layer with this spec (codes + scales, keys + values)."""
        return spec.num_kv_heads * sum(layout.bytes for layout in self.block_layouts(spec))

    def budget_block_bytes(self, spec: LayerSpec) -> int:
        """Bytes a fixed budget counts per block of one layer: its codes and scales, plus its sink stage (every block
        may be the first block of a sequence, which holds its first `sink_tokens` tokens in full precision)."""
        return self.block_bytes(spec) + self.sink_tokens * spec.bytes_per_token

    def budget_split(self, max_memory: int, spec: LayerSpec, num_layers: int | None) -> tuple[int | None, int]:
        """How a budget of `max_memory` bytes (all layers, each counted with `spec`) splits between full-precision
        stages and encoded blocks: one stage of ``block_size`` tokens per `ROW_BLOCKS` blocks (`budget_stages`), the
        rest to blocks (`budget_block_bytes`). Returns ``(stages, bytes left for blocks)``; the stages are the staging
        area's `capacity` in every layer group (a group holds them for its own layers). Without `num_layers`,
        ``(None, max_memory)``: `device_budget.blocks_for_budget` then refuses the budget.

        Raises:
            ValueError: the budget is below two stages plus one block.
        """
        if num_layers is None:
            return None, max_memory
        stage = self.block_size * spec.bytes_per_token * num_layers  # one stage, all layers
        stages = budget_stages(max_memory, stage, self.budget_block_bytes(spec) * num_layers)
        least = _MIN_BUDGET_STAGES * stage + self.budget_block_bytes(spec) * num_layers
        if max_memory < least:
            raise ValueError(
                f"max_memory={max_memory} bytes cannot hold a quantized pool: it needs at least {least} bytes, "
                f"{_MIN_BUDGET_STAGES} full-precision stages of {self.block_size} tokens ({stage} bytes each, the "
                f"partial last block of a row) plus one encoded block, over {num_layers} layers; raise max_memory "
                "or lower block_size.")
        return stages, max_memory - stages * stage

    def set_stage_capacity(self, stages: int) -> None:
        """Hold at most `stages` stages of open blocks (a fixed budget; `budget_split`), and at most one sink stage
        per block (call after the blocks are added: `budget_block_bytes` counts a sink stage in every block)."""
        self.staging.capacity = stages
        self.sinks.capacity = self.num_blocks

    def stage_capacity(self) -> int | None:
        """The most stages of open blocks this store holds (`set_stage_capacity`), or None: no limit."""
        return self.staging.capacity

    def stages_available(self) -> int | None:
        """Stages a step may still take: free, not yet allocated within the capacity, or returned at the step's
        start (earlier steps' encoded blocks every layer wrote); None: no limit."""
        free = self.staging.num_available()
        return None if free is None else free + self.states.num_freeable(len(self.specs))

    def num_staged(self, blocks: list[int]) -> int:
        """How many of `blocks` hold a stage (open blocks, and blocks encoded in the current step)."""
        return sum(1 for b in blocks if b in self.states.stage_of)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one encoded block across all known layers."""
        return sum(self.block_bytes(spec) for spec in self.specs.values())

    def bytes_in_use(self, num_used_blocks: int) -> int:
        """Bytes held for the blocks in use: their codes + scales, plus every full-precision stage handed out (the
        open, partial blocks, and a block encoded in the current step until the next step returns its stage) and
        every sink stage (the first tokens of each sequence)."""
        return num_used_blocks * self.bytes_per_block + self.staging.bytes_in_use() + self.sinks.bytes_in_use()

    def bytes_reserved(self) -> int:
        """Bytes of every storage tensor this store owns (`tensors()`): codes + scales of all blocks, plus the
        stages and sink stages allocated."""
        return self.num_blocks * self.bytes_per_block + self.staging.bytes_reserved() + self.sinks.bytes_reserved()

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor this store owns: codes, scales, stages and sink stages of every layer."""
        return self.storage.tensors() + self.staging.tensors() + self.sinks.tensors()

    def add_layer(self, layer_idx: int, spec: LayerSpec) -> None:
        """Storage for a new layer, with the same segments as the other layers: zero, or poisoned in debug mode
        (codes 0xFF, or NaN for float codes; scales NaN)."""
        assert layer_idx not in self.specs, f"layer {layer_idx} already has storage"
        layouts = self.block_layouts(spec)  # may raise ValueError before anything changes
        self.specs[layer_idx], self.layouts[layer_idx] = spec, layouts
        h, dev = spec.num_kv_heads, spec.device
        self.codes[layer_idx] = [SegmentedTensor(h, lay.code_size, lay.code_dtype, dev) for lay in layouts]
        self.scales[layer_idx] = [SegmentedTensor(h, lay.scale_size, lay.scale_dtype, dev) for lay in layouts]
        tensors = []
        for name, codes, scales in zip(("key", "value"), self.codes[layer_idx], self.scales[layer_idx]):
            for part, t in (("codes", codes), ("scales", scales)):
                poison = float("nan") if t.dtype.is_floating_point else _CODE_SENTINEL
                tensors.append(BlockTensor(f"{name}_{part}", t, (t.d2,), 0, poison))
        self.storage.add_layer(layer_idx, tuple(tensors))
        self.staging.add_layer(layer_idx, spec)
        self.sinks.add_layer(layer_idx, spec)

    def grow(self, num_blocks: int) -> None:
        """Extend every layer to `num_blocks` blocks by one new segment; existing blocks are not touched (no copy).
        All or nothing: when an allocation fails, the segments added to the other layers are dropped again."""
        self.storage.grow(num_blocks)
        self.states.grow(num_blocks)

    def shrink(self, num_blocks: int) -> int:
        """Drop the trailing segments that lie wholly at or past block `num_blocks` (the caller made sure those
        blocks are free, hence hold no stage); return the new `num_blocks`."""
        kept = self.storage.shrink(num_blocks)
        self.states.shrink(kept)
        return kept

    # -- block lifecycle -------------------------------------------------------------------------------------------
    def release(self, blocks: list[int]) -> None:
        """Blocks whose refcount reached 0: return their stages, forget their codes, poison them in debug mode."""
        self.states.release(blocks)
        self.storage.poison(blocks)

    def zero_blocks(self, blocks: list[int], layer_idx: int | None = None) -> None:
        """Make whole `blocks` hold zeros in every layer (or in layer `layer_idx` only): the pool's pad block. Zero
        codes and zero scales decode to zeros with every codec; the blocks count as encoded (once), hold no stage
        and no sink stage, so a read decodes them even as a last block (after a crop into padding)."""
        self.storage.fill_blocks(blocks, 0, layer_idx)
        if layer_idx is None:
            self.states.mark_encoded(blocks)

    def check_zero_blocks(self, blocks: list[int]) -> list[str]:
        """Problems (empty when fine): `blocks` (the pad block) not all-zero codes and scales in some layer, not
        encoded, or holding a stage or sink stage."""
        bad = self.storage.written_layers(blocks)
        problems = [f"blocks {blocks} were written in layers {bad[:10]}"] if bad else []
        odd = [b for b in blocks if not self.states.encoded[b] or b in self.states.stage_of
               or b in self.states.sink_of]
        if odd:
            problems.append(f"blocks {odd} were opened (staged, or given a sink stage)")
        return problems

    def poison_slots(self, slots: list[int]) -> None:
        """Debug mode: NaN-fill single staged slots (the tail of a cropped open block). Encoded blocks are poisoned
        past the kept tokens when they are reopened."""
        if not self.debug:
            return
        B = self.block_size
        for slot in slots:
            stage = self.states.stage_of.get(slot // B)
            if stage is not None:
                for store in (self.staging.keys, self.staging.values):
                    for t in store.values():
                        t[:, stage * B + slot % B] = float("nan")

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks `src[i]` -> `dst[i]` (fresh blocks) in every layer: codes, scales, state and stage."""
        if not src:
            return
        stages, sinks = self.states.copy(src, dst)
        self.storage.copy_blocks(src, dst)
        for idx in self.specs:
            self.staging.copy_stages(idx, stages)
            self.sinks.copy_stages(idx, sinks)

    def check(self, live: set[int]) -> list[tuple[int, str]]:
        """Problems given the `live` blocks, each as (invariant number, text): see `QuantizedBlockStates.check`."""
        return self.states.check(live)

    # -- the store interface (shared with PageStore) ------------------------------------------------------------
    def prepare_write(self, slots: torch.Tensor, device: torch.device, *, new_step: bool = True, start: int = 0,
                      num_new: int | None = None, positions: torch.Tensor | None = None) -> WritePlan:
        """The `WritePlan` of a step's tokens for every layer on `device` (see `QuantizedWriter.prepare_write`).

        Raises:
            ValueError: (accelerators, at a new step) the previous step wrote NaN or inf K/V into a quantized half.
        """
        return self.writer.prepare_write(slots, device, new_step=new_step, start=start, num_new=num_new,
                                         positions=positions)

    def write(self, layer_idx: int, target: WritePlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one layer's new tokens, `[rows, num_kv_heads, num_new_tokens, head_dim]`, as `target` (the `WritePlan`
        of `prepare_write`) says: encode the blocks they complete, stage the rest (see `QuantizedWriter.write`).

        Raises:
            ValueError: NaN or inf in a quantized half, on the CPU (nothing of this layer was written).
        """
        self.writer.write(layer_idx, target, key_states, value_states)

    # -- read (see `QuantizedReader`) -------------------------------------------------------------------------------
    def read(self, layer_idx: int, request: ReadRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``request.lo .. request.end - 1`` of every row, de-quantized, `[batch, num_kv_heads, n, head_dim]`
        keys and values."""
        return self.reader.read(layer_idx, request)

    def read_codes(self, layer_idx: int, request: ReadRequest) -> CodeRead | None:
        """The same tokens as codes and scales (`CodeRead`), or None when no encoded block lies in the range."""
        return self.reader.read_codes(layer_idx, request)

    def code_table(self, layer_idx: int, request: ReadRequest) -> CodeTable | None:
        """The same tokens where they lie, with each row's block ids (`CodeTable`), or None where that form does not
        hold. Equals ``layer_table(layer_idx, code_layout(request), request.new)``."""
        return self.reader.code_table(layer_idx, request)

    def code_layout(self, request: ReadRequest) -> CodeLayout | None:
        """The half of `code_table` that is the same for every layer (`CodeLayout`); None where it is None."""
        return self.reader.code_layout(request)

    def layer_table(self, layer_idx: int, layout: CodeLayout,
                    new: tuple[int, torch.Tensor, torch.Tensor] | None) -> CodeTable:
        """Layer `layer_idx`'s `CodeTable` of a read whose `CodeLayout` is `layout` (from `code_layout`, this step)."""
        return self.reader.layer_table(layer_idx, layout, new)

    # -- whole blocks out and in (prefix-cache files, the host tier) --------------------------------------------------
    def export_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of whole blocks in every layer, as stored, in the order of `blocks`: encoded blocks as their codes
        and scales (never re-quantized), open blocks as their full-precision stage, and the full-precision sink tokens
        of the blocks that hold a sequence's sink.

        Returns:
            `dict[str, torch.Tensor]`, on the layer's device: ``"{layer}.key_codes"`` / ``"{layer}.value_codes"``
            `[num_kv_heads, len(blocks), code_size]`, ``"{layer}.key_scales"`` / ``"{layer}.value_scales"``
            `[num_kv_heads, len(blocks), scale_size]` (meaningless for open blocks); ``"stage_rows"`` int64 `[m]`
            (positions in `blocks` of the `m` open blocks) with ``"{layer}.stage_keys"`` / ``"{layer}.stage_values"``
            `[num_kv_heads, m, block_size, dim]`; ``"sink_rows"`` int64 `[s]` (the blocks with a sink) with
            ``"{layer}.sink_keys"`` / ``"{layer}.sink_values"`` `[num_kv_heads, s, sink_tokens, dim]` (model dtype).
        """
        open_rows = [i for i, b in enumerate(blocks) if not self.states.encoded[b]]
        assert all(blocks[i] in self.states.stage_of for i in open_rows), "an open block without a stage"
        open_rows = [i for i, b in enumerate(blocks) if not self.states.encoded[b]]
        assert all(blocks[i] in self.states.stage_of for i in open_rows), "an open block without a stage"
        sink_rows = [i for i, b in enumerate(blocks) if b in self.states.sink_of]
        out = {"stage_rows": torch.tensor(open_rows, dtype=torch.long),
               "sink_rows": torch.tensor(sink_rows, dtype=torch.long)}
        parts = (("stage", self.staging, [self.states.stage_of[blocks[i]] for i in open_rows], self.block_size),
                 ("sink", self.sinks, [self.states.sink_of[blocks[i]] for i in sink_rows], self.sink_tokens))
        dense = self.storage.export_blocks(blocks)  # "{layer}.{key,value}_{codes,scales}": [heads, n, size]
        for idx in self.specs:
            for half, name in enumerate(("key", "value")):
                for kind in ("codes", "scales"):
                    out[f"{idx}.{name}_{kind}"] = dense[f"{idx}.{name}_{kind}"]
                for part, area, stages, length in parts:  # [heads, len(stages), length, dim]
                    out[f"{idx}.{part}_{name}s"] = area.read_stages((area.keys, area.values)[half], idx, stages, length)
        return out

    def import_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Make fresh blocks (just allocated: no stage, not encoded) hold what `export_blocks` returned, as it was:
        encoded blocks with their codes and scales (no re-quantization), open ones staged, sinks kept.

        Raises:
            ValueError: a tensor missing or not of the shape and dtype this store's codecs use (another
                quantization), or rows out of range (nothing is written then).
        """
        rows = {}
        for part in ("stage", "sink"):
            t = tensors.get(f"{part}_rows")
            if t is None or t.dim() != 1 or t.dtype != torch.long:
                raise ValueError(f"import_blocks: no int64 '{part}_rows' tensor (a block export of another storage "
                                 "format?).")
            rows[part] = t.tolist()
            if any(not 0 <= r < len(blocks) for r in rows[part]) or len(set(rows[part])) != len(rows[part]):
                raise ValueError(f"import_blocks: {part} rows {rows[part][:10]} do not name distinct blocks of the "
                                 f"{len(blocks)}.")
        dense, want = self.storage.export_shapes(len(blocks)), {}
        for idx, spec in self.specs.items():
            for name, dim in (("key", spec.key_dim), ("value", spec.value_dim)):
                for kind in ("codes", "scales"):
                    want[f"{idx}.{name}_{kind}"] = dense[f"{idx}.{name}_{kind}"]
                want[f"{idx}.stage_{name}s"] = ((spec.num_kv_heads, len(rows["stage"]), self.block_size, dim),
                                                spec.dtype)
                want[f"{idx}.sink_{name}s"] = ((spec.num_kv_heads, len(rows["sink"]), self.sink_tokens, dim),
                                               spec.dtype)
        check_block_tensors(want, tensors)
        fresh = [b for b in blocks if self.states.encoded[b] or b in self.states.stage_of or b in self.states.sink_of]
        assert not fresh, f"import_blocks into blocks {fresh[:10]} that are not fresh"
        self.states.check_stages(len(rows["stage"]))  # PoolExhaustedError before anything is written
        for i in rows["stage"]:
            self.states.stage_of[blocks[i]] = self.staging.allocate()
        for i in rows["sink"]:
            self.states.sink_of[blocks[i]] = self.sinks.allocate()
        parts = (("stage", self.staging, [self.states.stage_of[blocks[i]] for i in rows["stage"]]),
                 ("sink", self.sinks, [self.states.sink_of[blocks[i]] for i in rows["sink"]]))
        self.storage.write_blocks(blocks, tensors)
        for idx in self.specs:
            for half, name in enumerate(("key", "value")):
                for part, area, stages in parts:
                    area.write_stages((area.keys, area.values)[half], idx, stages, tensors[f"{idx}.{part}_{name}s"])
        staged = {blocks[i] for i in rows["stage"]}
        for b in blocks:
            self.states.encoded[b] = self.states.num_encodes[b] = 0 if b in staged else 1


__all__ = ["QuantizedPageStore", "ROW_BLOCKS", "WritePlan", "budget_stages"]
