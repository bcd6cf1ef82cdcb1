"""How a `BlockPool(max_memory=...)` budget maps onto devices when a model's layers sit on several (`device_map`).

One block id names the same slot range in every layer, so every layer holds all `num_blocks` blocks, on the device
of its own K/V (`LayerSpec.device`: with ``device_map="auto"`` layer 0 may be on ``cuda:0`` and layer 20 on
``cuda:1``). `max_memory` is the budget of all layers on all devices together; a device holds the blocks of the
layers on it::

    num_blocks     = max_memory // (bytes of one block of the first layer * num_layers)
    bytes on dev d = num_blocks * sum(bytes of one block of layer l, for the layers l on d)

The pool is sized when its first layer registers (the later layers' devices are not known yet), then each layer's
device share is checked against that device's memory before the layer's storage is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hf_pagedkv.errors import counted
from hf_pagedkv.storage.page_store import LayerSpec

MemoryOf = Callable[[torch.device], "int | None"]  # total bytes of a device, None when it cannot be told
BlockBytes = Callable[[LayerSpec], int]  # bytes of one block of one layer, keys plus values


def device_shares(specs: Iterable[LayerSpec], block_bytes: BlockBytes, num_blocks: int) -> dict[torch.device, int]:
    """Bytes a pool of `num_blocks` blocks holds on each device: every layer holds every block, on its own device.

    Args:
        specs (iterable of `LayerSpec`): the layers, each with its device.
        block_bytes (`Callable[[LayerSpec], int]`): bytes of one block of one layer (the store's `block_bytes`).
        num_blocks (`int`): blocks in the pool.

    Returns:
        `dict[torch.device, int]`: device -> bytes, for the devices that hold at least one layer.
    """
    shares: dict[torch.device, int] = {}
    for spec in specs:
        shares[spec.device] = shares.get(spec.device, 0) + num_blocks * block_bytes(spec)
    return shares


def devices_like(device: torch.device) -> list[torch.device]:
    """The devices of `device`'s type this process can place layers on: every visible CUDA device, else `device`."""
    if device.type == "cuda" and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [device]


def blocks_for_budget(max_memory: int, spec: LayerSpec, num_layers: int | None, block_bytes: BlockBytes,
                      memory_of: MemoryOf) -> int:
    """Blocks a budget of `max_memory` bytes buys: ``max_memory // (block_bytes(spec) * num_layers)``.

    NOTE: every layer is counted with the first layer's shape (`spec`): the pool is sized before the other layers
    have run. That is exact for models whose layers all have the same KV heads, head_dim and dtype.

    NOTE: the budget is compared with all devices of the first layer's type together (every visible GPU for
    ``cuda``; the RAM for ``cpu``), the most the layers can spread over when their K/V all sit on one device type,
    as with GPU-only `device_map`s, tensor parallel and CPU runs. This fails fast on a budget that cannot fit
    before anything is allocated; the exact per-device check is `check_device_share`, layer by layer.

    Args:
        max_memory (`int`): the budget in bytes, all layers on all devices.
        spec (`LayerSpec`): the first layer to register.
        num_layers (`int` or `None`): layers that store K/V (None when the cache was created without a config).
        block_bytes, memory_of: as in `device_shares` and `check_device_share`.

    Raises:
        ValueError: `num_layers` is None; the budget is more than all devices of `spec.device`'s type have
            together (one device for the CPU), so the pool could never fit; the budget is below one block.
    """
    devices = devices_like(spec.device)
    sizes = [memory_of(d) for d in devices]
    if all(s is not None for s in sizes) and max_memory > sum(sizes):
        where = f"{spec.device} has" if len(devices) == 1 else f"the {len(devices)} {spec.device.type} devices have"
        together = "" if len(devices) == 1 else " together"
        raise ValueError(
            f"max_memory={max_memory} bytes is more than {where}{together} ({sum(sizes)} bytes in all); "
            "preallocating it would fail or get the process killed. Lower max_memory."
        )
    if num_layers is None:
        raise ValueError(
            "BlockPool(max_memory=...) needs the number of layers to size itself: create the cache "
            "as PagedCache(config=model.config, pool=pool), or use num_blocks= instead."
        )
    per_block = block_bytes(spec) * num_layers
    n = max_memory // per_block
    if n == 0:
        raise ValueError(
            f"max_memory={max_memory} bytes is less than one block ({per_block} bytes for "
            f"{counted(num_layers, 'layer')}); raise max_memory or lower block_size."
        )
    return n


def check_device_share(layer_idx: int, spec: LayerSpec, known: Iterable[LayerSpec], block_bytes: BlockBytes,
                       num_blocks: int, max_memory: int, memory_of: MemoryOf) -> None:
    """Refuse a layer whose storage would take its device past that device's memory.

    Args:
        layer_idx (`int`): the layer being registered.
        spec (`LayerSpec`): its shape and device.
        known (iterable of `LayerSpec`): the layers already registered (on any device).
        block_bytes (`Callable[[LayerSpec], int]`): bytes of one block of one layer.
        num_blocks (`int`): blocks in the pool (every layer holds all of them).
        max_memory (`int`): the pool's budget, for the message.
        memory_of (`Callable[[torch.device], int | None]`): total bytes of a device (`block_pool.device_memory`);
            a device whose memory is unknown (None) is not checked.

    Raises:
        ValueError: the layers on `spec.device`, this one included, would hold more bytes than the device has.
    """
    on_device = [s for s in known if s.device == spec.device] + [spec]
    share = device_shares(on_device, block_bytes, num_blocks)[spec.device]
    have = memory_of(spec.device)
    if have is not None and share > have:
        raise ValueError(
            f"BlockPool(max_memory={max_memory}) would hold {share} bytes on {spec.device} once layer {layer_idx} is "
            f"stored there ({counted(len(on_device), 'layer')} x {counted(num_blocks, 'block')}), more than "
            f"{spec.device} has ({have} bytes in all). max_memory is the budget of all layers on all devices together, "
            "and each device holds every block of the layers placed on it: lower max_memory, or put fewer layers on "
            f"{spec.device} (device_map)."
        )


def check_preallocation(layer_idx: int, spec: LayerSpec, num_layers: int | None, held: int, block_bytes: int,
                        num_blocks: int, block_size: int, memory_of: MemoryOf) -> None:
    """Refuse a layer of a fixed pool (`BlockPool(num_blocks=...)`) whose storage would not fit its device.

    A fixed pool preallocates all `num_blocks` blocks in every layer (a CPU store may be committed lazily by the
    OS, so the allocation can succeed and the process be killed later). Checked before the layer's storage is
    made: the layers on `spec.device` with this one, and, when `num_layers` is known, the whole pool (every layer
    counted with this one's shape) against all devices of `spec.device`'s type (as `blocks_for_budget`), so a
    cache built with a config fails at its first layer, before anything is allocated.

    Args:
        layer_idx (`int`): the layer being registered.
        spec (`LayerSpec`): its shape and device.
        num_layers (`int` or `None`): layers that store K/V (None when the cache was created without a config).
        held (`int`): bytes the pool already holds on `spec.device` for the layers registered before.
        block_bytes (`int`): bytes of one block of this layer (keys plus values).
        num_blocks (`int`): blocks in the pool (every layer holds all of them).
        block_size (`int`): tokens per block, for the message.
        memory_of (`Callable[[torch.device], int | None]`): total bytes of a device, None when unknown (then not
            checked).

    Raises:
        ValueError: naming `num_blocks`, the bytes it would take, the memory there is, and `max_memory` as the
            alternative.
    """
    devices = devices_like(spec.device)
    sizes = [memory_of(d) for d in devices]
    checks = []  # (bytes needed, bytes there, "<where> has", what the bytes are)
    if num_layers is not None and all(s is not None for s in sizes):
        where = f"{spec.device} has" if len(devices) == 1 else f"the {len(devices)} {spec.device.type} devices have"
        what = f"{counted(num_layers, 'layer')} x {num_blocks:,} blocks x {block_bytes:,} bytes"
        checks.append((num_blocks * block_bytes * num_layers, sum(sizes), where, what))
    have = memory_of(spec.device)
    if have is not None:
        what = f"layer {layer_idx}'s {num_blocks:,} blocks x {block_bytes:,} bytes"
        what += f", plus {held:,} bytes of the layers already there" if held else ""
        checks.append((held + num_blocks * block_bytes, have, f"{spec.device} has", what))
    for need, have, where, what in checks:
        if need > have:
            raise ValueError(
                f"BlockPool(num_blocks={num_blocks:,}) preallocates every block ({block_size} tokens) in every layer: "
                f"{what} = {need:,} bytes, more than {where} ({have:,} bytes in all); nothing was allocated for "
                f"layer {layer_idx}. Give fewer blocks (at most about {num_blocks * have // need:,} fit), or size "
                "the pool from a byte budget with max_memory= (e.g. max_memory='4GiB')."
            )
