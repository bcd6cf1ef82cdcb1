"""`PrefixIndex`: chain hashes of full blocks -> block id, and the LRU of cached-idle blocks. Pure Python.

The scheme is vLLM's automatic prefix caching (and SGLang's RadixAttention in spirit): a full block is named by
a hash of its parent block's hash and its own token ids, so equal hashes mean equal token prefixes, and a
later request with the same prefix attaches to the blocks already computed instead of recomputing them.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from hf_pagedkv.errors import counted

if TYPE_CHECKING:
    from hf_pagedkv.blocks.block_allocator import BlockAllocator

_DIGEST_BYTES = 16  # blake2b-128: collisions are negligible for any number of blocks a pool sees


class BlockHash(NamedTuple):
    """The name of a full block's content: its token ids and everything before them.

    `digest` is ``blake2b(parent.digest + token ids)``; the first block's parent digest is ``blake2b(key)``, where
    `key` holds whatever else changes the K/V (model fingerprint, quantization config), so equal digests mean
    equal tokens from position 0 through this block, computed by the same model into the same format.
    """

    digest: bytes  # 16 bytes
    num_tokens: int  # tokens from the start of the sequence through the end of this block (a multiple of B)


def hash_blocks(token_ids: Sequence[int], block_size: int, key: bytes) -> list[BlockHash]:
    """Chain hashes of the full blocks of `token_ids` (a trailing partial block is not hashed).

    Args:
        token_ids (`Sequence[int]`): the tokens of one sequence from position 0, without padding.
        block_size (`int`): tokens per block.
        key (`bytes`): the identity of everything else the K/V depend on (see `BlockHash`).

    Returns:
        `list[BlockHash]`, one per full block, in order: ``len(token_ids) // block_size`` hashes.
    """
    tokens = array("q", token_ids)  # int64 ids, fixed width so equal ids hash equal
    parent = hashlib.blake2b(key, digest_size=_DIGEST_BYTES).digest()
    out = []
    for j in range(len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
        h.update(tokens[j * block_size: (j + 1) * block_size].tobytes())  # this block's ids
        parent = h.digest()
        out.append(BlockHash(parent, (j + 1) * block_size))
    return out


class PrefixIndex:
    """Which blocks hold which full-block prefixes, and which of them are idle (evictable), oldest first.

    A block id is published (named by exactly one `BlockHash`) only once all its tokens are written in every
    layer, and is never written again while published (`PagedCache` copies it first). A published block is either
    in use (refcount >= 1, owned by the allocator's counts) or **cached-idle** (refcount 0, in `idle`), waiting
    to be hit again or evicted least-recently-used when the pool needs space; eviction clears its hash.

    Invariants (checked by `BlockPool.check_invariants`): `_by_hash` and `_by_block` are inverse maps; every idle
    block is published and has refcount 0; no published block is free. Not thread-safe by itself: `BlockPool`
    calls it under `pool.lock`.
    """

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}  # hash -> block id; changed by publish / evict only
        self._by_block: dict[int, BlockHash] = {}  # block id -> hash; the inverse of _by_hash
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached-idle blocks, least recently released first
        self.num_lookups = 0  # prefix lookups (one per request)
        self.num_lookup_tokens = 0  # tokens those lookups asked about
        self.num_hit_tokens = 0  # tokens served from cached blocks
        self.num_evictions = 0  # idle blocks whose hash was dropped to make room

    def __contains__(self, block: object) -> bool:
        """Whether `block` is published (holds a named full prefix)."""
        return block in self._by_block

    @property
    def num_published_blocks(self) -> int:
        return len(self._by_block)

    @property
    def num_idle_blocks(self) -> int:
        return len(self._idle)

    def idle_blocks(self) -> list[int]:
        """Cached-idle blocks in eviction order (least recently released first)."""
        return list(self._idle)

    def published(self) -> dict[int, BlockHash]:
        """A copy of block id -> hash for every published block (for checks and tests)."""
        return dict(self._by_block)

    def match(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks of the longest published prefix of `hashes` (stops at the first miss). Changes nothing."""
        blocks = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def acquire(self, hashes: Iterable[BlockHash], allocator: BlockAllocator, num_tokens: int,
                count: bool = True) -> list[int]:
        """Take one reference to each block of the longest published prefix of `hashes`; count the lookup.

        Idle blocks are revived (refcount 0 -> 1, out of the LRU); blocks in use get one more reference.
        """
        blocks = self.match(hashes)
        for b in blocks:
            if b in self._idle:
                del self._idle[b]
                allocator.revive(b)
            else:
                allocator.incref([b])
        if count:
            self.num_lookups += 1
            self.num_lookup_tokens += num_tokens
            self.num_hit_tokens += self._by_block[blocks[-1]].num_tokens if blocks else 0
        return blocks

    def release(self, blocks: Sequence[int], allocator: BlockAllocator) -> list[int]:
        """Drop one reference from each block; published blocks reaching refcount 0 become idle, most recently
        used last. Return the blocks that became free."""
        freed = allocator.decref(blocks, keep=self._by_block)
        # NOTE: park in reverse so a sequence's tail blocks are evicted before its head: a prefix is reachable only
        # through its first blocks, so they are the most valuable (as in vLLM).
        for b in reversed(dict.fromkeys(blocks)):
            if b in self._by_block and b not in self._idle and allocator.refcount(b) == 0:
                self._idle[b] = None
        return freed

    def publish(self, h: BlockHash, block: int) -> bool:
        """Name `block` by `h`; return False (nothing changed) if `h` already names a block.

        Raises:
            ValueError: `block` is already published under another hash (the caller passed token ids other than
                the ones whose K/V the block holds).
        """
        known = self._by_block.get(block)
        if known is not None:
            if known != h:
                raise ValueError(
                    f"block {block} is already published for other tokens (prefix of "
                    f"{counted(known.num_tokens, 'token')}); publish() must get exactly the token ids whose K/V the "
                    "cache holds, without padding."
                )
            return False
        if h in self._by_hash:
            return False
        self._by_hash[h] = block
        self._by_block[block] = h
        return True

    def evict(self, n: int, allocator: BlockAllocator) -> list[int]:
        """Drop the `n` least recently released idle blocks from the index (their hashes are cleared) and hand
        them to the allocator's free set; return their ids."""
        assert n <= len(self._idle), f"evict({n}) with {len(self._idle)} idle blocks"
        out = []
        for _ in range(n):
            b, _ = self._idle.popitem(last=False)
            del self._by_hash[self._by_block.pop(b)]
            out.append(b)
        allocator.add_free(out)
        self.num_evictions += n
        return out

    def rename(self, mapping: dict[int, int]) -> None:
        """Compaction moved blocks `b -> mapping[b]`: published ones keep their hash, idle ones their LRU place."""
        for src, dst in mapping.items():
            h = self._by_block.pop(src, None)
            if h is not None:
                self._by_block[dst] = h
                self._by_hash[h] = dst
        if any(b in self._idle for b in mapping):
            self._idle = OrderedDict((mapping.get(b, b), None) for b in self._idle)

    def check(self, free: set[int], num_blocks: int) -> list[str]:
        """Consistency problems (empty when fine): the two maps are inverse, idle blocks are published, and no
        published block is free or out of range."""
        problems = []
        if len(self._by_hash) != len(self._by_block) or any(self._by_hash.get(h) != b
                                                              for b, h in self._by_block.items()):
            problems.append("hash -> block and block -> hash are not inverse maps")
        stray = [b for b in self._idle if b not in self._by_block]
        if stray:
            problems.append(f"idle blocks {stray[:20]} are not published")
        stale = sorted(b for b in self._by_block if b in free or not 0 <= b < num_blocks)
        if stale:
            problems.append(f"free or unknown blocks {stale[:20]} are still published")
        return problems

    # -- for the host tier (pool/host_tiers.py) ------------------------------------------------------------------------
    def hash_of(self, block: int) -> BlockHash | None:
        """The hash naming `block`, or None when it is not published."""
        return self._by_block.get(block)

    def block_of(self, h: BlockHash) -> int | None:
        """The block `h` names, or None."""
        return self._by_hash.get(h)

    def oldest_idle(self, n: int) -> list[int]:
        """The `n` idle blocks `evict(n)` would drop, in that order. Changes nothing."""
        return list(itertools.islice(self._idle, n))

    def forget(self, block: int, allocator: BlockAllocator) -> None:
        """Drop one idle block from the index (its hash cleared) and free it: its content moved to another tier."""
        assert block in self._idle, f"forget of block {block}, which is not cached-idle"
        del self._idle[block]
        del self._by_hash[self._by_block.pop(block)]
        allocator.add_free([block])
