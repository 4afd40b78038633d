"""KV cache events: what the prefix cache holds, told as vLLM tells it (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), for a router that routes each request to the replica caching most of its prefix.

A *block* is one full page of the prefix index (:class:`~hybridserve.cache.prefix_index.PageNode`):
``block_size`` tokens (16) after its parent's. A ``BlockStored`` event carries one chain of new blocks, each
the child of the one before, the first the child of ``parent_block_hash`` (None: a child of the root), with
their tokens; ``BlockRemoved`` names evicted blocks; ``AllBlocksCleared`` says the whole cache was dropped.

A block's hash is a chained content hash: the first 8 bytes of SHA-256 over the parent's hash and the block's
token ids, as an unsigned integer below 2**63. The same prefix has the same hashes on every replica and across
restarts, so a consumer may treat them as opaque keys (vllm-router does: it hashes the tokens itself).

A hybrid model's hit also needs a recurrent-state snapshot at the position it resumes from (docs/prefix_caching.md):
the blocks tell where a request's KV is cached, and snapshots sit at prompt ends, generation ends and branch
points along them, so a request that shares a published prefix resumes at its snapshot nearest below. Only
full blocks are published (a partly filled last page, or a snapshot's tail, is not).

Only the unsalted tree is published. The blocks of requests with a ``cache_salt`` (:mod:`hybridserve.cache.salt`)
are never recorded: an event carries its blocks' token ids, and a salt exists to keep a tenant's prompts from
everyone else. (A router that hashes tokens itself could not route by a salted block anyway.)

This module is bookkeeping only (no sockets, no encoding): :class:`KVEventRecorder` collects events while
the engine steps, and the server's publisher (:mod:`hybridserve.entrypoints.openai.kv_events`) takes them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from hybridserve.cache.prefix_index import PageNode


@dataclass(frozen=True)
class BlockStored:
    """A chain of new blocks: ``block_hashes[i]``'s parent is ``block_hashes[i - 1]``, the first's is
    ``parent_block_hash``; ``token_ids`` is their tokens, ``block_size`` per block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

_HASH_BITS = 63  # unsigned and below 2**63: an integer every msgpack reader takes (signed or not)


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The chained hash of a block of ``tokens`` whose parent block has hash ``parent`` (None: the root)."""
    h = hashlib.sha256((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest()[:8], "little") >> (64 - _HASH_BITS)


class KVEventRecorder:
    """Collects the prefix index's block events between two :meth:`take` calls (the engine thread's only)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hash: dict["PageNode", int] = {}  # every published block
        self._events: list[KVEvent] = []
        self._chain: list["PageNode"] = []  # blocks stored since the last event, each a child of the one before

    def stored(self, node: "PageNode") -> None:
        """``node`` was added to the index (a child of its parent, published or the root); a salted one is
        not recorded."""
        if node.salt is not None:
            return
        if self._chain and node.parent is not self._chain[-1]:
            self._flush_chain()
        parent = node.parent
        self._hash[node] = block_hash(self._hash.get(parent) if parent is not None else None, node.tokens)
        self._chain.append(node)

    def removed(self, node: "PageNode") -> None:
        """``node`` was taken out of the index."""
        self._flush_chain()
        h = self._hash.pop(node, None)
        if h is None:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # evictions come in runs: one event for the run
            self._events[-1] = BlockRemoved(last.block_hashes + (h,))
        else:
            self._events.append(BlockRemoved((h,)))

    def cleared(self) -> None:
        """The whole index was dropped: what was not yet told is moot."""
        self._chain.clear()
        self._hash.clear()
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        """The events since the last call, in order."""
        self._flush_chain()
        events, self._events = self._events, []
        return events

    def hash_of(self, node: "PageNode") -> int | None:
        return self._hash.get(node)

    def _flush_chain(self) -> None:
        if not self._chain:
            return
        first = self._chain[0].parent
        self._events.append(BlockStored(
            block_hashes=tuple(self._hash[n] for n in self._chain),
            parent_block_hash=self._hash.get(first) if first is not None else None,
            token_ids=tuple(t for n in self._chain for t in n.tokens),
            block_size=self.block_size))
        self._chain = []
