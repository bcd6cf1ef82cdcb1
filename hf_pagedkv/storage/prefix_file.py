"""The prefix-cache file: published KV blocks in a safetensors file whose header holds a small JSON index.

One file, written atomically (to a temporary file in the same folder, then `os.replace`), so a save interrupted at
any point leaves the previous file as it was. Layout::

    header metadata "hf_pagedkv": JSON index
        format, version        "hf_pagedkv.prefix_cache", 1
        model_key              hex of the prefix key the blocks were hashed under (`pool/fingerprint.py`
                               `prefix_key`: blake2b of the model fingerprint and the storage format)
        block_size, quant      tokens per block; repr of the pool's `QuantConfig` (or `GroupQuant`)
        quant_fields           the `QuantConfig` fields of a uniformly quantized pool, else null
        group_quant            when the kinds of groups differ: {"sliding": fields or null, "full": ...}
        groups                 one per layer group: window (null: full attention), num_blocks, quant (repr of the
                               group's `QuantConfig`), and per layer {num_kv_heads, key_dim, value_dim, dtype}
        checksums              tensor name -> sha256 of its dtype, shape and bytes
    tensors
        g{i}.digests           uint8 [num_blocks, 16]  the blocks' chain-hash digests (`BlockHash.digest`)
        g{i}.num_tokens        int64 [num_blocks]      `BlockHash.num_tokens`
        g{i}.{name}            what the group's store `export_blocks` returned (fp: K/V per layer; quantized: codes,
                               scales and sink tokens, as stored)

This module knows the format only; which blocks go in and where they land is `hf_pagedkv/pool/prefix_persistence.py`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT = "hf_pagedkv.prefix_cache"  # the index's "format" field
VERSION = 1  # the index's "version" field; a reader refuses other versions
_META_KEY = "hf_pagedkv"  # the safetensors header metadata entry holding the JSON index


@dataclass(frozen=True)
class PrefixFile:
    """The verified contents of a prefix-cache file (every checksum matched).

    Attributes:
        index (`dict`): the JSON index (see the module docstring), without its checksums.
        tensors (`dict[str, torch.Tensor]`): every tensor of the file, on the CPU.
    """

    index: dict
    tensors: dict[str, torch.Tensor]


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's dtype, shape and bytes (row-major)."""
    h = hashlib.sha256()
    h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy())  # raw bytes [numel * itemsize]
    return h.hexdigest()


def write_prefix_file(path: str | os.PathLike, index: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` (moved to the CPU) and `index` (checksums added) to `path`, atomically.

    The data go to a temporary file next to `path`, which is flushed to disk and then renamed over `path`
    (`os.replace`, atomic on POSIX and Windows); on any error the temporary file is removed and `path` is untouched.

    Returns:
        `int`: bytes written.

    Raises:
        ValueError: `path` is not a path (or is empty).
        OSError: `path` is a directory or another file that is not a regular one (a device, a pipe: the atomic
            replace would put a regular file in its place), its folder is missing or not writable, or the disk is
            full (`path` unchanged); the message names `path`.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path={path!r}: give the prefix-cache file to write, e.g. 'prefix.safetensors'.")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a directory; give the prefix-cache file to write in it, e.g. "
                                f"{str(path / 'prefix.safetensors')!r}.")
    if path.exists() and not path.is_file():
        raise OSError(errno.EINVAL, f"{str(path)!r} exists and is not a regular file (a device or a pipe): saving "
                      "replaces the file atomically, which would replace it; give a regular file's path, e.g. "
                      "'prefix.safetensors'.")
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    full = {**index, "format": FORMAT, "version": VERSION,
            "checksums": {name: tensor_checksum(t) for name, t in cpu.items()}}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # the folder is missing or not writable: name the file asked for, not the temporary one
        raise type(e)(e.errno, f"cannot write the prefix-cache file {str(path)!r}: {e.strerror} (its folder "
                               f"{str(path.parent)!r} must exist and be writable)") from e
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a saved cache is an ordinary data file
        save_file(cpu, tmp, metadata={_META_KEY: json.dumps(full, sort_keys=True)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_prefix_index(path: str | os.PathLike) -> dict:
    """The JSON index of a prefix-cache file, from its header only (tensors neither read nor verified).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a prefix-cache file of this version, or a header too damaged to read; a directory.
    """
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; pass the prefix-cache file that pool.save_prefix_cache(path) "
                         "wrote.")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable prefix-cache file (truncated or corrupted: {e}); save it "
                         "again with pool.save_prefix_cache(path).") from None
    try:
        index = json.loads(meta[_META_KEY])
    except (KeyError, ValueError):
        raise ValueError(f"{path} is a safetensors file without a readable hf_pagedkv index; it was not written "
                         "by BlockPool.save_prefix_cache.") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a prefix-cache file (format {index.get('format')!r}, expected {FORMAT!r}).")
    if index.get("version") != VERSION:
        raise ValueError(f"{path} is a prefix-cache file of version {index.get('version')!r}; this hf_pagedkv reads "
                         f"version {VERSION}. Save it again with this version.")
    return index


def read_prefix_file(path: str | os.PathLike) -> PrefixFile:
    """Read and verify a whole prefix-cache file: the index, then every tensor against its checksum.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a prefix-cache file of this version; truncated (the header names more bytes than the file
            holds); a tensor missing, extra, or whose bytes do not match its checksum (corrupted).
    """
    index = read_prefix_index(path)
    try:
        tensors = load_file(str(path), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path} is truncated or corrupted ({e}); nothing was loaded. Save it again.") from None
    sums = index.pop("checksums", None)
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        missing = sorted(set(sums or ()) ^ set(tensors))[:5]
        raise ValueError(f"{path} is corrupted: its tensors do not match its index (differing names {missing}); "
                         "nothing was loaded. Save it again.")
    bad = [name for name, t in tensors.items() if tensor_checksum(t) != sums[name]]
    if bad:
        raise ValueError(f"{path} is corrupted: the checksums of {len(bad)} tensors do not match (first: "
                         f"{sorted(bad)[:3]}); nothing was loaded. Save it again.")
    return PrefixFile(index, tensors)
