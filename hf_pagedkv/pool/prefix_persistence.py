"""A prefix cache that survives a restart: save a pool's published blocks to a file, load them into another pool.

`BlockPool.save_prefix_cache` / `BlockPool.load_prefix_cache` call these. A block is named by its chain hash
(`blocks/prefix_index.py`), which already covers the tokens from position 0, the model's weights and the storage
format, so a loaded block is hit exactly when the same model would have computed the same K/V into the same
format. Loaded blocks become cached-idle prefix blocks (refcount 0, in the prefix index), as if a request in this
process had published them and finished: `PagedCache.from_prefix` hits them, and the pool evicts them (least
recently used, the tails of the longest prefixes first) when it needs the room. The file format is
`storage/prefix_file.py`.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from hf_pagedkv._compat import layer_plan
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.pool.fingerprint import prefix_key
from hf_pagedkv.pool.group_quant import KINDS, GroupQuant
from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.blocks.prefix_index import BlockHash
from hf_pagedkv.storage.page_store import LayerSpec
from hf_pagedkv.storage.host_store import select_blocks
from hf_pagedkv.storage.prefix_file import read_prefix_file, read_prefix_index, write_prefix_file

_SPEC_FIELDS = ("num_kv_heads", "key_dim", "value_dim")  # per-layer shape fields of the index


def save_prefix_cache(pool, path: str | os.PathLike, model=None, config=None) -> int:
    """Write every published block of `pool` (in use or cached-idle, every layer group, both tiers) to `path`
    atomically.

    Returns:
        `int`: blocks written, summed over layer groups.

    Raises:
        ValueError: the pool has no prefix caching; the key the blocks were hashed under is unknown (no
            `publish` in this pool and no `model=`) or not unique (blocks of two models or formats), or `model`
            is not the model the blocks were published for.
        OSError: `path` cannot be written (the previous file, if any, is unchanged).
    """
    if not pool.prefix_caching:
        raise ValueError("save_prefix_cache needs a pool created with BlockPool(prefix_caching=True).")
    with pool.lock:  # published blocks are never written, but an idle one could be evicted and reused
        key = _saved_key(pool, model, config)
        formats = pool.settings.quant  # the `GroupQuant`: each group's format
        index = {"model_key": key.hex(), "block_size": pool.block_size, "quant": repr(pool.quant),
                 "quant_fields": dataclasses.asdict(pool.quant) if formats.uniform and pool.quant.is_quantized
                 else None, "groups": []}
        if formats.uniform is None:  # kinds of groups differ: each kind's fields
            index["group_quant"] = formats.to_fields()
        tensors: dict[str, torch.Tensor] = {}
        for g in pool.groups:
            published = g.prefix_index.published()  # block -> hash
            blocks = sorted(published, key=lambda b: (published[b].num_tokens, published[b].digest))
            hashes = [published[b] for b in blocks]
            export = g.store.export_blocks(blocks) if blocks else {}
            if pool.host is not None:  # and the prefix blocks the device evicted to the host tier
                host_hashes, host_export = pool.host.cached(g.index)
                if host_hashes:
                    hashes += host_hashes
                    export = ({k: torch.cat([t.cpu(), host_export[k]], 1) for k, t in export.items()} if export
                              else host_export)
            index["groups"].append({
                "window": g.window, "num_blocks": len(hashes), **({"tier": g.tier} if g.tier else {}),
                "quant": repr(formats.for_window(g.window)),
                "layers": {str(i): {**{f: getattr(s, f) for f in _SPEC_FIELDS}, "dtype": _dtype_name(s.dtype)}
                           for i, s in sorted(g.store.specs.items())},
            })
            if not hashes:
                continue
            p = f"g{g.index}."
            digests = b"".join(h.digest for h in hashes)
            tensors[p + "digests"] = torch.frombuffer(bytearray(digests), dtype=torch.uint8).view(len(hashes), -1)
            tensors[p + "num_tokens"] = torch.tensor([h.num_tokens for h in hashes], dtype=torch.long)
            tensors.update({p + name: t.cpu() for name, t in export.items()})
    write_prefix_file(path, index, tensors)
    return sum(grp["num_blocks"] for grp in index["groups"])


def open_prefix_cache(pool_or_cls, path: str | os.PathLike, model, config, device, pool_kwargs: dict):
    """`BlockPool.load_prefix_cache`: load `path` into the pool `pool_or_cls`, or into a new pool of the class
    `pool_or_cls` with the file's block size and quantization, built with `pool_kwargs`. Returns that pool, its
    `last_loaded_blocks` set.

    Raises:
        ValueError: `pool_kwargs` given with a pool; the file's index records an unreadable quantization; and as
            `load_prefix_cache`.
    """
    if not isinstance(pool_or_cls, type):
        if pool_kwargs:
            raise ValueError(f"pool.load_prefix_cache got pool settings {sorted(pool_kwargs)}; they size a new "
                             "pool (BlockPool.load_prefix_cache(path, ..., num_blocks=...)).")
        pool = pool_or_cls
    else:
        index = read_prefix_index(path)
        try:
            if index.get("group_quant"):
                quant = GroupQuant.from_fields(index["group_quant"])
            else:
                quant = QuantConfig(**index["quant_fields"]) if index.get("quant_fields") else None
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"{path}: the index records an unreadable quantization "
                             f"{index.get('group_quant') or index.get('quant_fields')!r}.") from None
        pool = pool_or_cls(block_size=index.get("block_size"), prefix_caching=True, quant=quant, **pool_kwargs)
    pool.last_loaded_blocks = load_prefix_cache(pool, path, model, config, device)
    return pool


def load_prefix_cache(pool, path: str | os.PathLike, model=None, config=None, device=None) -> int:
    """Make the blocks of a prefix-cache file cached-idle prefix blocks of `pool`.

    Everything is checked before the pool changes: the file (checksums), its format against the pool's (block
    size, quantization, layer groups and their windows, per-layer shapes and dtype), and its model key against
    `model`'s. Layers the pool does not hold yet get their storage here (on `device`, by default the model's), as a
    first forward pass would. Blocks whose chain hash the pool already holds are skipped. When the device tier
    cannot take every block of a layer group, the blocks of the shortest prefixes go there and the rest into the
    pool's host tier (`BlockPool(host_memory=...)`) as cached blocks, which a hit copies back like any block the
    device evicted.

    Returns:
        `int`: blocks newly published in the pool, summed over layer groups.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the pool has no prefix caching; neither `model` nor `config`; the file is truncated or
            corrupted, of another format, block size or quantization, of another model's layers, or for other
            weights (nothing loaded in each case); the model is spread over several devices (`device_map`) and
            the pool does not hold its layers yet.
        PoolExhaustedError: a fixed pool has too few free plus cached-idle blocks for the file, and no host tier
            to take the rest, or too little room there (nothing loaded).
    """
    if not pool.prefix_caching:
        raise ValueError("load_prefix_cache needs a pool created with BlockPool(prefix_caching=True).")
    if model is None and config is None:
        raise ValueError("load_prefix_cache needs `model=` (its weights' fingerprint keys the blocks); or `config=` "
                         "for a pool whose caches are keyed by config alone.")
    f = read_prefix_file(path)
    index, config = f.index, (model.config if model is not None else config)
    plan = layer_plan(config)
    try:
        groups = [(grp["window"], int(grp["num_blocks"]), {int(i): s for i, s in grp["layers"].items()},
                   int(grp.get("tier", 0))) for grp in index["groups"]]  # tier: a PyramidKV cache's upper tiers
        group_formats = [grp.get("quant") for grp in index["groups"]]  # None in a file of a uniform pool
        file_key, block_size, quant = index["model_key"], index["block_size"], index["quant"]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"{path}: the index is malformed (fields missing); nothing was loaded.") from None
    if block_size != pool.block_size:
        also = "" if quant == repr(pool.quant) else f" and stored as {quant}"
        quant_arg = "" if quant == repr(pool.quant) else f"quant={_quant_arg(index)}, "
        raise ValueError(f"{path} holds blocks of {counted(block_size, 'token')}{also}, this pool uses "
                         f"block_size={pool.block_size}; load it into a BlockPool(block_size={block_size}, "
                         f"{quant_arg}prefix_caching=True) (nothing loaded).")
    for (window, _, _, tier), fmt in zip(groups, group_formats):
        ours = repr(pool.settings.quant.for_window(window))
        if fmt is not None and fmt != ours:
            kind = "full-attention" if window is None else f"sliding-window ({window} tokens)"
            raise ValueError(f"{path} holds its {kind} layer group{f' (tier {tier})' if tier else ''} stored as "
                             f"{fmt}, this pool stores that group as {ours} (pool quant={pool.quant.name}); load it "
                             f"into a pool with quant={_quant_arg(index)} (nothing loaded).")
    if quant != repr(pool.quant):
        raise ValueError(f"{path} holds blocks stored as {quant}, this pool stores {pool.quant!r}; load it into a "
                         "pool with that quant= (nothing loaded).")
    with pool.lock:
        specs = _file_specs(pool, groups, plan, model, device, path)
        key = prefix_key(pool, model, config)
        if file_key != key.hex():
            raise ValueError(f"{path} was saved for other model weights (model key {file_key[:12]}..., this model "
                             f"and pool give {key.hex()[:12]}...); its blocks would be wrong for this model. Nothing "
                             "was loaded.")
        for (window, _, _, tier), layer_specs in zip(groups, specs):
            gi = pool.group_for(window, tier)
            for layer_idx, spec in layer_specs.items():
                pool.layers.register(layer_idx, spec, len(plan), gi)
        targets = []  # (pool group, file group, blocks for the device tier, blocks for the host tier)
        for fi, (window, n, _, tier) in enumerate(groups):
            if not n:
                continue
            gi = pool.group_for(window, tier)
            alloc = pool.groups[gi].allocator
            on_device = n if pool.groups[gi].can_reserve(n) else alloc.num_free_blocks + alloc.num_idle_blocks
            room = pool.host.room_for_cached(gi) if pool.host is not None and on_device < n else 0
            if n - on_device > room:
                host = (f" and its host tier room for {room}" if pool.host is not None
                        else "; a host tier (BlockPool(host_memory=...)) would take the rest")
                raise PoolExhaustedError(
                    f"load_prefix_cache: {path} needs {counted(n, 'block')} in the {pool.groups[gi].name} layer group, "
                    f"the pool has {alloc.num_free_blocks} free and {alloc.num_idle_blocks} cached-idle of "
                    f"{alloc.num_blocks}{host}; raise num_blocks / max_memory / host_memory or release caches (nothing "
                    "loaded).")
            targets.append((gi, fi, on_device, n - on_device))
        loaded = _import(pool, f.tensors, targets)
        pool.prefix_keys.setdefault(bytes(key))
        return loaded


def _import(pool, tensors: dict[str, torch.Tensor], targets: list[tuple[int, int, int, int]]) -> int:
    """Allocate, write, publish and park the blocks of each `(pool group, file group, device blocks, host blocks)`:
    the blocks of the shortest prefixes go to the device tier, the rest to the host tier as cached blocks (its
    least recently used end: the longest prefixes' tails are dropped first). On any error undo what was done
    (nothing is published on the device before every group is written). Called with `pool.lock` held."""
    held: list[tuple[int, list[int], list[BlockHash]]] = []  # per target: device blocks and their hashes
    parked: list[tuple[int, list[int]]] = []  # per target: host blocks loaded
    try:
        for gi, fi, n_dev, n_host in targets:
            n, p = n_dev + n_host, f"g{fi}."
            mine = {name[len(p):]: t for name, t in tensors.items() if name.startswith(p)}
            digests, num_tokens = mine.pop("digests"), mine.pop("num_tokens")
            if tuple(digests.shape) != (n, 16) or tuple(num_tokens.shape) != (n,):
                raise ValueError(f"the file's hashes of group {fi} do not match its {counted(n, 'block')} (nothing "
                                 "loaded).")
            counts = num_tokens.tolist()
            hashes = [BlockHash(bytes(digests[j].tolist()), counts[j]) for j in range(n)]
            order = sorted(range(n), key=lambda j: counts[j])  # a saved file lists device blocks before host ones
            dev, rest = order[:n_dev], order[n_dev:]
            blocks = pool._allocate(n_dev, group=gi) if n_dev else []
            held.append((gi, blocks, [hashes[j] for j in dev]))
            if n_dev:
                export = mine if dev == list(range(n)) else select_blocks(mine, dev)
                pool.groups[gi].store.import_blocks(blocks, export)
                pool.groups[gi].mark_written(blocks, [pool.block_size] * n_dev)
            if rest:
                rest.reverse()  # the longest prefixes first: dropped first
                host_export = {k: t.cpu() for k, t in select_blocks(mine, rest).items()}
                parked.append((gi, pool.host.load(gi, [hashes[j] for j in rest], host_export)))
    except BaseException:
        for gi, host in parked:
            pool.host.unload(gi, host)
        for gi, blocks, _ in held:
            pool._free(blocks, gi)
        raise
    published = sum(len(host) for _, host in parked)
    for gi, blocks, hashes in held:
        published += pool.groups[gi].publish(hashes, blocks)  # a hash the pool holds already is skipped
        pool._free(blocks, gi)  # published: cached-idle; skipped ones: free again
    return published


def _file_specs(pool, groups, plan, model, device, path) -> list[dict[int, LayerSpec]]:
    """Each file group's layers as `LayerSpec`s on the devices they will live on, after checking them against the
    model's layer plan and the layers the pool already holds."""
    default = None
    out = []
    for window, _, layers, _ in groups:
        specs = {}
        for layer_idx, s in layers.items():
            if not 0 <= layer_idx < len(plan) or plan[layer_idx][0] == "dummy" or plan[layer_idx][1] != window:
                want = "absent" if not 0 <= layer_idx < len(plan) else f"window {plan[layer_idx][1]}"
                raise ValueError(f"{path} holds layer {layer_idx} with window {window}, but this model's layer "
                                 f"{layer_idx} is {want}: the file is for another architecture (nothing loaded).")
            dtype = getattr(torch, str(s.get("dtype")), None)
            if not isinstance(dtype, torch.dtype) or any(not isinstance(s.get(k), int) for k in _SPEC_FIELDS):
                raise ValueError(f"{path}: layer {layer_idx} of the index is malformed (nothing loaded).")
            known = next((g.store.specs[layer_idx] for g in pool.groups if layer_idx in g.store.specs), None)
            if known is None:
                if default is None:
                    default = _default_device(model, device)
                dev = default
            else:
                dev = known.device
            spec = LayerSpec(s["num_kv_heads"], s["key_dim"], s["value_dim"], dtype, dev)
            if known is not None and known != spec:
                raise ValueError(f"{path} holds layer {layer_idx} as {s}, this pool holds it as {known}; the file "
                                 "is for another model or dtype (nothing loaded).")
            specs[layer_idx] = spec
        out.append(specs)
    return out


def _default_device(model, device) -> torch.device:
    """Where layers the pool does not hold yet get their storage: `device`, or the model's one device."""
    if device is not None:
        return torch.device(device)
    if model is None:
        return torch.device("cpu")
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        raise ValueError("load_prefix_cache: the model is spread over several devices (device_map) and this pool "
                         "does not hold its layers yet; run one forward step with a PagedCache on this pool first "
                         "(it places each layer's storage on its device), then load.")
    return next(model.parameters()).device


def _saved_key(pool, model, config) -> bytes:
    """The prefix key the pool's published blocks were hashed under (checked against `model` when given)."""
    with pool.lock:
        noted = list(pool.prefix_keys)
    given = prefix_key(pool, model, config) if model is not None or config is not None else None
    if given is not None:
        if noted and noted != [given]:
            raise ValueError("save_prefix_cache: this pool's blocks were published for another model (or another "
                             "config= key) than `model`; pass the model that computed them, or none.")
        return given
    if len(noted) == 1:
        return noted[0]
    if not noted:
        raise ValueError("save_prefix_cache: nothing was published through a PagedCache in this pool, so the model "
                         "is unknown; pass model= (the model the blocks belong to).")
    raise ValueError(f"save_prefix_cache: this pool holds blocks published under {len(noted)} different model keys "
                     "(caches keyed by model= and by config=, or two models); a file holds one model's blocks.")


def _quant_arg(index: dict) -> str:
    """The `quant=` that makes a pool of a file's formats, for an error message."""
    if index.get("group_quant"):
        fields = index["group_quant"]
        return repr({k: QuantConfig(**fields[k]).name if fields.get(k) else "fp" for k in KINDS})
    return repr(QuantConfig(**index["quant_fields"]).name if index.get("quant_fields") else "fp")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
