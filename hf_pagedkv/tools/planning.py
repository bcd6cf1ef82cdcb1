"""Capacity planning: KV bytes per token from a model config, pool size for a workload, and block-size tuning.

The byte formula lives in one function, `kv_bytes_per_head_token`, which asks the codecs the quantized store uses
for their block layouts, so the planner and the store count the same bytes. The textbook check (a 7B Llama: 32
layers, 32 KV heads, head_dim 128, fp16)::

    2 (K and V) x 32 layers x 32 heads x 128 x 2 bytes = 524,288 bytes = 512 KiB per token
    4096 tokens x batch 16 x 512 KiB = 32 GiB

Tensor parallel (`from_pretrained(..., tp_plan="auto")` on `tp` ranks) splits `k_proj`/`v_proj` by output columns,
so each rank computes and caches `num_kv_heads / tp` heads of every layer; `plan_capacity(..., tp=N)` counts one
rank's share (`kv_heads_per_rank`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from hf_pagedkv._compat import layer_plan
from hf_pagedkv.errors import counted
from hf_pagedkv.storage.codecs import codec_name, make_codec
from hf_pagedkv.storage.quantized_store import MAX_BUDGET_STAGES, ROW_BLOCKS, budget_stages
from hf_pagedkv.config import (DEFAULT_BLOCK_SIZE, DEFAULT_QUANT_BLOCK_SIZE, QuantConfig, check_block_size,
                               check_positive_int, parse_bytes)

POOL_HEADROOM = 1.2  # the pool to set is the peak KV times this
BLOCK_SIZE_CANDIDATES = (4, 8, 16, 32, 64, 128)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def kv_bytes_per_head_token(head_dim: int, key_bits: int | None = None, value_bits: int | None = None, *,
                            block_size: int = DEFAULT_QUANT_BLOCK_SIZE, value_group_size: int = 64,
                            dtype_bytes: int = 2) -> float:
    """Bytes one token of one KV head takes in a full block, keys plus values, as the store lays blocks out.

    Keys are quantized per channel with the block's `block_size` tokens as the group, values per token in groups
    of `value_group_size` along `head_dim` (KIVI, arXiv 2402.02750); scales are fp16 (`codecs/`)::

        keys, int8 (symmetric):  head_dim          + head_dim * 2 / block_size        (one scale per channel)
        keys, int4/int2:         head_dim * bits/8 + head_dim * 4 / block_size        (scale and minimum)
        values, int8:            head_dim          + head_dim / value_group_size * 2
        values, int4/int2:       head_dim * bits/8 + head_dim / value_group_size * 4
        full precision (bits None): head_dim * dtype_bytes

    Args:
        head_dim (`int`): channels per head.
        key_bits, value_bits (`int` or `None`): 8, 4, 2, or None for full precision.
        block_size (`int`): tokens per block (the key group).
        value_group_size (`int`): channels per value group (capped at `head_dim`, which it must divide).
        dtype_bytes (`int`): bytes of one full-precision element (2 for fp16/bf16, 4 for fp32).

    Raises:
        ValueError: bits other than None, 8, 4, 2; a non-positive size; a group size or block size the codecs
            cannot pack (say a value group that does not divide `head_dim`).
    """
    for name, value in (("head_dim", head_dim), ("block_size", block_size), ("value_group_size", value_group_size),
                        ("dtype_bytes", dtype_bytes)):
        check_positive_int(name, value)
    total = 0.0
    for name, bits, axis in (("key_bits", key_bits, "channel"), ("value_bits", value_bits, "token")):
        if bits not in (None, 8, 4, 2):
            raise ValueError(f"`{name}` must be None (full precision), 8, 4 or 2, got {bits!r}.")
        if bits is None:
            total += head_dim * dtype_bytes
        else:
            total += make_codec(codec_name("torch", bits), axis, value_group_size).bytes_per_token(block_size, head_dim)
    return total


def plan_formats(quant: str | dict) -> tuple[str, dict[str, str]]:
    """`plan_capacity`'s `quant` -> (the plan's name for it, {"full": preset, "sliding": preset}).

    `quant` is a preset name for every layer, or one per kind of layer group as `BlockPool(quant=...)` takes it,
    ``{"sliding": None, "full": "k4v4"}`` (a kind left out, or None: ``"fp"``); the name is the preset's, or
    ``"sliding=fp,full=k4v4"`` when the kinds differ.

    Raises:
        ValueError: an unknown preset, or a dict key other than "sliding" and "full"; the message names it.
    """
    if not isinstance(quant, dict):
        return _preset(quant), {"full": _preset(quant), "sliding": _preset(quant)}
    unknown = [k for k in quant if k not in ("sliding", "full")]
    if unknown:
        raise ValueError(f"quant={quant!r}: unknown layer-group key {unknown[0]!r}; the keys are 'sliding', 'full'.")
    presets = {kind: "fp" if quant.get(kind) is None else quant[kind] for kind in ("full", "sliding")}
    for kind, preset in presets.items():
        try:
            presets[kind] = _preset(preset)
        except ValueError as e:
            raise ValueError(f"quant[{kind!r}]={preset!r}: give None or a preset name ({e})") from e
    name = presets["full"] if presets["full"] == presets["sliding"] else \
        f"sliding={presets['sliding']},full={presets['full']}"
    return name, presets


def _preset(name: str) -> str:
    """A preset name `QuantConfig.preset` accepts, in lower case (``"K4V4R"`` -> ``"k4v4r"``).

    Raises:
        ValueError: a name it does not accept (the message gives the ladder and the ``k<b>v<b>`` grammar).
    """
    if not isinstance(name, str):
        raise ValueError(f"`quant` must be a preset name such as 'k8v4', got {name!r}.")
    QuantConfig.preset(name)
    return name.lower()


def _preset_bytes_per_head_token(head_dim: int, preset: str, *, block_size: int, value_group_size: int,
                                 dtype_bytes: int) -> float:
    """`kv_bytes_per_head_token` of any preset name: integer codes of 8, 4, 3 or 2 bits and fp8 codes take what
    their codec says (`storage.codecs.codecs_for`); a rotation costs no byte."""
    config = QuantConfig.preset(preset, value_group_size=value_group_size)
    if config.key_format == config.value_format == "int" and 3 not in (config.key_bits, config.value_bits):
        return kv_bytes_per_head_token(head_dim, config.key_bits, config.value_bits, block_size=block_size,
                                       value_group_size=value_group_size, dtype_bytes=dtype_bytes)
    total = 0.0
    for bits, fmt, axis in ((config.key_bits, config.key_format, "channel"),
                            (config.value_bits, config.value_format, "token")):
        if bits is None:
            total += head_dim * dtype_bytes
        else:
            codec = make_codec(codec_name("torch", bits, fmt, config.fp8_scales), axis, value_group_size)
            total += codec.bytes_per_token(block_size, head_dim)
    return total


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds when tensor parallel splits `num_kv_heads` over `tp` ranks.

    Raises:
        ValueError: `tp` is not a positive int, or does not divide `num_kv_heads` (a rank would hold part of a
            head, which transformers' column-wise split of `k_proj`/`v_proj` cannot run); the message lists the
            `tp` values that work.
    """
    check_positive_int("tp", tp)
    if num_kv_heads % tp:
        divisors = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0]
        raise ValueError(
            f"tp={tp} does not divide the model's {counted(num_kv_heads, 'KV head')}: tensor parallel gives each rank "
            f"num_key_value_heads / tp whole heads. Use tp in {divisors}."
        )
    return num_kv_heads // tp


@dataclass(frozen=True)
class ModelShape:
    """What the KV size depends on, read from a model config."""

    name: str
    num_layers: int  # layers that store K/V
    num_sliding: int  # of which sliding-window (or chunked) layers
    sliding_window: int | None  # their window in tokens
    num_kv_heads: int
    head_dim: int
    num_params: int | None  # parameters of the whole model (None when it could not be counted)

    @classmethod
    def from_config(cls, config, name: str = "model") -> ModelShape:
        """Read the layer types (`_compat.layer_plan`), KV heads and head_dim from a transformers config.

        Raises:
            ValueError: a layer type PagedCache does not store.
        """
        text = config.get_text_config(decoder=True)
        plan = [(kind, window) for kind, window in layer_plan(config) if kind != "dummy"]
        windows = [w for _, w in plan if w is not None]
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(name, len(plan), len(windows), max(windows) if windows else None, kv_heads, head_dim,
                   _count_params(config))


def _count_params(config) -> int | None:
    """Parameters of the model `config` describes, counted on the meta device (no memory, no download)."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 -- an architecture without a causal-LM class: report the weights as unknown
        return None


def load_config(model: str | None):
    """A transformers config from the default model (None or ``"SmolLM2-135M-Instruct"``), a local directory, a
    ``config.json`` or ``.gguf`` file, a model type (``"llama"``: that class's default config) or a Hub id.

    Raises:
        ValueError: none of these could be read (the message lists what is accepted).
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_pagedkv.tools.models import DEFAULT_MODEL, GGUF_FILE, default_model_dir

    try:
        if model is None or model == DEFAULT_MODEL:
            return AutoConfig.from_pretrained(default_model_dir(), gguf_file=GGUF_FILE)
        if os.path.isfile(model) and model.endswith(".gguf"):
            folder, file = os.path.split(os.path.abspath(model))
            return AutoConfig.from_pretrained(folder, gguf_file=file)
        if os.path.isfile(model):
            with open(model, encoding="utf-8") as fh:
                data = json.load(fh)
            return AutoConfig.for_model(data.pop("model_type"), **data)
        if os.path.isdir(model):
            return AutoConfig.from_pretrained(model)
        if model in CONFIG_MAPPING:
            return AutoConfig.for_model(model)
        return AutoConfig.from_pretrained(model)
    except Exception as e:  # any loader failure becomes one clear message
        raise ValueError(
            f"--model {model!r}: could not read a config ({type(e).__name__}: {e}). Give the default "
            f"{DEFAULT_MODEL!r}, a local directory, a config.json or .gguf file, a model type such as 'llama', "
            "or a Hub id available offline."
        ) from e


@dataclass(frozen=True)
class CapacityPlan:
    """The KV memory a workload needs and the pool to set. Bytes are keys plus values over all layers, for one rank
    when `tp > 1` (each rank holds `kv_heads_per_rank` heads; the whole job holds `tp` times as much)."""

    model: ModelShape
    quant: str  # preset name, or "sliding=<preset>,full=<preset>" when the kinds of layer groups differ
    dtype: str  # full-precision dtype of K/V and weights
    block_size: int
    max_seq_len: int  # tokens per sequence
    batch: int  # sequences at once
    tp: int  # tensor-parallel ranks (1: no tensor parallel)
    kv_heads_per_rank: int  # model.num_kv_heads / tp
    bytes_per_token: float  # one token, all layers, in a full block (as PagedCache stores it)
    seq_bytes: int  # one sequence of max_seq_len tokens, whole blocks (quantized: the partial last block also staged
    #                 in full precision, and the sink tokens); sliding-window layers hold the blocks of their window
    kv_bytes: int  # batch * seq_bytes: the peak KV while decoding
    window_kv_bytes: int  # the same if sliding-window layers kept exactly their window (DynamicCache(config=...))
    weight_bytes: int | None  # parameters * dtype bytes, / tp rounded up (about one rank's: see plan_capacity)
    pool_blocks: int  # the BlockPool to set: ceil(peak blocks * POOL_HEADROOM) (+ the prefix cache's blocks)
    pool_bytes: int  # its bytes: pool_max_memory, plus (quantized) the full-precision stages and sinks of `batch` rows
    memory: int | None  # the memory it must fit in (one rank's device when tp > 1)
    fits: bool | None  # weights + pool <= memory (None without a memory)
    prefix_cache_bytes: int = 0  # of pool_bytes: room for cached-idle prefix blocks (`prefix_cache_memory`)
    block_bytes: int = 0  # one block, all layers (encoded when quantized): what BlockPool(max_memory=) divides by
    pool_max_memory: int = 0  # BlockPool(max_memory=pool_max_memory) holds pool_blocks (and, quantized, num_stages)
    num_stages: int = 0  # quantized: full-precision stages inside pool_max_memory (2 per row at once), else 0
    stage_bytes: int = 0  # quantized: one stage (a block of every layer in full precision), else 0

    def to_dict(self) -> dict:
        return asdict(self)


def plan_capacity(model: ModelShape, max_seq_len: int, batch: int, quant: str | dict = "fp", dtype: str = "float16",
                  block_size: int | None = None, value_group_size: int = 64, memory: int | None = None,
                  tp: int = 1, prefix_cache_memory: int | str | None = None) -> CapacityPlan:
    """Plan the KV memory of `batch` sequences of `max_seq_len` tokens (see `CapacityPlan`). `block_size` defaults
    to what `PagedCache` uses: 16 tokens, 32 when any layer group is quantized. A quantized sequence also holds its
    first `QuantConfig.sink_tokens` tokens in full precision. `quant` is a preset, or one per kind of layer group
    (``{"sliding": None, "full": "k4v4"}``, `plan_formats`): each kind's layers are counted in their own format.

    With `tp > 1` every byte count is one rank's: its `num_kv_heads / tp` heads (the block count is the same on
    every rank), and `memory` is one rank's device. The weights are counted as `parameters / tp`.

    `prefix_cache_memory` (a size, as `BlockPool(prefix_cache_memory=...)`) adds room for that many bytes of
    cached-idle prefix blocks to the pool to set (`prefix_cache_bytes`, whole blocks), so the live sequences still
    fit while the prefix cache is full.

    NOTE: `parameters / tp` slightly undercounts a rank's weights: modules the TP plan does not shard (norms, and
    whatever a model's plan leaves whole) are replicated on every rank. For Llama-2-7B those are its 266,240 norm
    weights of 6,738,415,616 parameters (`LlamaForCausalLM.tp_plan` shards the embeddings and `lm_head` too).

    Sliding-window layers form their own layer group and hold, per sequence, the blocks of the last
    ``window - 1`` tokens and the token being decoded (``ceil(n / B) - floor((n - window) / B)`` blocks), which
    `seq_bytes` and `kv_bytes` count; `window_kv_bytes` counts exactly the window, as `DynamicCache(config=...)`.
    The pool to set (`pool_blocks`, `pool_bytes`) is sized as if every layer held every token: a fixed `BlockPool`
    gives each layer group the same number of blocks, and the full-attention group needs them all (a prefill also
    holds the whole prompt in every layer until the first decode step). ``BlockPool(max_memory=pool_max_memory)``
    holds exactly `pool_blocks` blocks: it divides its budget by `block_bytes` (one block of every layer; encoded
    codes and scales when quantized), so `pool_max_memory` is a whole number of blocks. A quantized pool also keeps
    each row's open (partial) block and its sink tokens in full precision, inside that budget: it gives one
    full-precision stage per `ROW_BLOCKS` blocks (2 to 256 stages; `quantized_store.budget_stages`; a row holds up to
    two at once, so `batch` rows need ``2 * batch``) and the rest to blocks with room for a sink stage each; the plan's
    `pool_max_memory` is the least budget that holds both `batch` rows' stages and the blocks (`pool_blocks` is then
    what that budget holds, at least the peak x 1.2), and `pool_bytes` equals it.

    Raises:
        ValueError: a non-positive length, batch or block size, a block size over `MAX_BLOCK_SIZE`; an unknown
            `quant` preset (or dict key) or `dtype`; a `tp` that does not divide the KV heads (`kv_heads_per_rank`).
    """
    check_positive_int("max_seq_len", max_seq_len)
    check_positive_int("batch", batch)
    kv_heads = kv_heads_per_rank(model.num_kv_heads, tp)
    quant, presets = plan_formats(quant)  # the plan's name; kind ("full", "sliding") -> preset
    quantized = {kind: QuantConfig.preset(p).is_quantized for kind, p in presets.items()}
    if block_size is None:  # one block size for the pool, as `BlockPool`: 32 when any group is quantized
        block_size = DEFAULT_QUANT_BLOCK_SIZE if any(quantized.values()) else DEFAULT_BLOCK_SIZE
    check_block_size(block_size)
    # full-precision sink tokens per sequence, in each quantized kind of group
    sinks = {kind: min(QuantConfig().sink_tokens, max_seq_len) if q else 0 for kind, q in quantized.items()}
    if dtype not in _DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(_DTYPES)}, got {dtype!r}.")
    dtype_bytes = _DTYPES[dtype].itemsize
    per_heads = {kind: _preset_bytes_per_head_token(model.head_dim, p, block_size=block_size,
                                                    value_group_size=value_group_size, dtype_bytes=dtype_bytes)
                 for kind, p in presets.items()}  # kind -> bytes per head and token in a full block
    fp_per_head = kv_bytes_per_head_token(model.head_dim, dtype_bytes=dtype_bytes)
    layers = {"full": model.num_layers - model.num_sliding, "sliding": model.num_sliding}
    heads = model.num_layers * kv_heads
    per_head = sum(layers[k] * per_heads[k] for k in layers) / model.num_layers  # the mean over layers

    def seq_bytes(tokens_full: int, tokens_window: int) -> int:
        """Whole blocks for `tokens_full` tokens in full layers and `tokens_window` in sliding ones."""
        total = 0.0
        for kind, tokens in (("full", tokens_full), ("sliding", tokens_window)):
            full, partial = divmod(tokens, block_size)
            # a quantized group holds a partial block twice: its (not yet written) encoded slot and its stage
            partial_cost = (per_heads[kind] + fp_per_head if quantized[kind] else fp_per_head) if partial else 0
            total += layers[kind] * kv_heads * block_size * (full * per_heads[kind] + partial_cost)
            # the sink tokens' full-precision copy lives with block 0: a sliding row that dropped it holds none
            if kind == "full" or tokens_window >= max_seq_len:
                total += layers[kind] * kv_heads * sinks[kind] * fp_per_head
        return math.ceil(total)

    one = seq_bytes(max_seq_len, max_seq_len)
    window = min(max_seq_len, model.sliding_window) if model.sliding_window else max_seq_len
    # a sliding row drops the blocks wholly before its window (that of the last decode step, which started at n - 1)
    held = max_seq_len - (max(0, max_seq_len - window) // block_size) * block_size if model.sliding_window \
        else max_seq_len
    seq_blocks = -(-max_seq_len // block_size)
    pool_blocks = math.ceil(seq_blocks * batch * POOL_HEADROOM)
    weights = None if model.num_params is None else -(-model.num_params * dtype_bytes // tp)
    # NOTE: `BlockPool(max_memory=m)` holds m // block_bytes blocks, so the budget to print is a whole number of
    # blocks (a budget of peak bytes x 1.2 would hold one block less than ceil(peak blocks x 1.2)). `round`: per_head
    # is a float holding a whole number of bytes per block
    block_bytes = round(heads * per_head * block_size)
    staged = max(0, one - seq_blocks * block_bytes)  # quantized: the open block's stage and the sinks, per row
    prefix_bytes = 0
    if prefix_cache_memory is not None:  # whole blocks of the idle prefix cache, on top of the live sequences
        prefix_size = parse_bytes(prefix_cache_memory, "prefix_cache_memory")
        prefix_blocks = prefix_size // block_bytes
        if prefix_blocks == 0:
            raise ValueError(f"prefix_cache_memory={prefix_size:,} bytes holds no block: one block of "
                             f"{block_size} tokens takes {block_bytes:,} bytes in this format; give at least "
                             f"{block_bytes:,} bytes, or leave it out for no prefix cache room.")
        prefix_bytes = prefix_blocks * block_bytes
        pool_blocks += prefix_blocks
    pool_max_memory = pool_blocks * block_bytes
    pool_bytes = pool_max_memory + staged * batch
    num_stages = stage_bytes = 0
    if any(quantized.values()):  # the stages and sinks sit inside max_memory (`QuantizedPageStore.budget_split`)
        stage_bytes = round(heads * fp_per_head * block_size)
        per_block = block_bytes + round(heads * fp_per_head * QuantConfig().sink_tokens)  # its sink stage
        need = min(2 * batch, MAX_BUDGET_STAGES)  # the pool keeps at most that many (128 rows at once)
        # the least budget whose own split (`budget_stages`: one stage per ROW_BLOCKS blocks) gives both
        row = stage_bytes + ROW_BLOCKS * per_block  # one stage and its ROW_BLOCKS blocks
        pool_max_memory = max(need * row, min(pool_blocks * row // ROW_BLOCKS,
                                              pool_blocks * per_block + MAX_BUDGET_STAGES * stage_bytes))
        while True:  # the pool's own split of that budget: at least `need` stages and pool_blocks blocks
            num_stages = budget_stages(pool_max_memory, stage_bytes, per_block)
            fit_blocks = (pool_max_memory - num_stages * stage_bytes) // per_block
            if fit_blocks >= pool_blocks and num_stages >= need:
                break
            pool_max_memory += per_block
        pool_blocks, pool_bytes = fit_blocks, pool_max_memory
    fits = None if memory is None else (weights or 0) + pool_bytes <= memory
    held_one = seq_bytes(max_seq_len, held)
    return CapacityPlan(model, quant, dtype, block_size, max_seq_len, batch, tp, kv_heads, heads * per_head, held_one,
                        held_one * batch, seq_bytes(max_seq_len, window) * batch, weights, pool_blocks, pool_bytes,
                        memory, fits, prefix_bytes, block_bytes, pool_max_memory, num_stages, stage_bytes)


@dataclass(frozen=True)
class BlockSizeRow:
    """Cost of one block size on a set of sequence lengths."""

    block_size: int
    fragmentation: float  # unused slots in allocated blocks / allocated slots, at the final lengths
    mean_entries: float  # block-table entries per sequence
    max_entries: int


def tune_block_size(lengths: list[int], candidates: tuple[int, ...] = BLOCK_SIZE_CANDIDATES,
                    max_waste: float = 0.05) -> tuple[list[BlockSizeRow], int, str]:
    """Internal fragmentation and block-table entries per candidate block size, and a recommendation.

    The recommendation is the largest block size whose fragmentation stays at or below `max_waste`: larger blocks
    mean fewer table entries and allocations, longer contiguous runs (read as views) and, when quantized, fewer
    key scales per token; smaller blocks waste less memory and let prefix caching share finer prefixes.

    Returns:
        `(rows, recommended block size, reason)`.

    Raises:
        ValueError: no lengths, a length that is not a positive int, or a bad candidate / `max_waste`.
    """
    if not lengths:
        raise ValueError("`lengths` is empty: give at least one sequence length (tokens).")
    bad = [x for x in lengths if isinstance(x, bool) or not isinstance(x, int) or x <= 0]
    if bad:
        raise ValueError(f"sequence lengths must be positive ints (tokens), got {bad[:5]}.")
    for b in candidates:
        check_positive_int("block size candidate", b)
    if not 0 <= max_waste < 1:
        raise ValueError(f"`max_waste` must be in [0, 1), got {max_waste!r}.")
    total = sum(lengths)
    rows = []
    for b in sorted(candidates):
        entries = [-(-n // b) for n in lengths]
        rows.append(BlockSizeRow(b, 1 - total / (sum(entries) * b), sum(entries) / len(lengths), max(entries)))
    ok = [r for r in rows if r.fragmentation <= max_waste]
    if ok:
        best = ok[-1]
        larger = next((r for r in rows if r.block_size > best.block_size), None)
        reason = (f"the largest block size with internal fragmentation <= {max_waste:.0%} "
                  f"({best.fragmentation:.1%}, {best.mean_entries:.1f} table entries per sequence)")
        if larger is not None:
            reason += f"; {larger.block_size} would waste {larger.fragmentation:.1%}"
    else:
        best = rows[0]
        reason = (f"no candidate keeps fragmentation <= {max_waste:.0%} on sequences this short (median "
                  f"{sorted(lengths)[len(lengths) // 2]} tokens); the smallest wastes least ({best.fragmentation:.1%})")
    return rows, best.block_size, reason
