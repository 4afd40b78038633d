"""The prefix index: which cached KV pages and recurrent-state snapshots hold which token prefixes.

A tree of full pages: each :class:`PageNode` stands for ``block_size`` tokens following its
parent's, with the KV page that holds them (``None`` for a model without attention). A path from
the root spells a token prefix a page at a time, so a prompt is matched by walking down with its
tokens, and the first token where it leaves the tree (its *divergence point*) is found to the token
by comparing with the children's tokens.

A :class:`Snapshot` is a state slot holding the recurrent state (every state tensor, conv windows
included) after exactly ``position`` tokens. It hangs on the node of its last full page, with the
``tail`` tokens after that page (fewer than ``block_size``) and the partly filled page holding
their KV (``tail_page``). Snapshots sit at any token position, so hits are token-granular. A model
without recurrent state keeps the same records without a slot (``slot`` None): the partly filled last
page of a finished sequence, so the next turn of a chat reuses its KV to the token.

Each cache salt (:mod:`hybridserve.cache.salt`) has a tree of its own: the salt is the key of the root a
path starts from, so requests with different salts never match each other's pages or snapshots, while
requests with the same salt share exactly as unsalted ones do. Unsalted requests use :attr:`PrefixIndex.root`;
a salted root is made when its salt first caches something and dropped when it holds nothing again.

This module is pure bookkeeping over ids: it owns no pool memory. :mod:`hybridserve.cache.prefix_cache`
holds the references, copies the bytes and decides what to evict; here are the tree, the match and
a priority queue of eviction candidates with lazy invalidation (an item pushed again after it
changed makes its older entries stale).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

#: children compared token by token when locating a divergence point inside a page
MAX_CHILDREN_SCANNED = 256
#: nodes visited at most looking for the snapshot past a divergence point (:meth:`PrefixIndex.snapshot_past`)
MAX_NODES_SEARCHED = 256


def root_key(salt: str | None) -> int:
    """The key of ``salt``'s root: every key below it is chained from it (:func:`chain_key`)."""
    return hash(("cache_salt", salt))


def chain_key(parent_key: int, tokens: tuple[int, ...]) -> int:
    """The key of the page holding ``tokens`` under the page (or root) keyed ``parent_key``: a hash of the salt
    and every token from the start, computed a page at a time (it names a prefix that may no longer be cached)."""
    return hash((parent_key, tokens))


@dataclass(eq=False)
class PageNode:
    """``block_size`` tokens after the parent's, and the KV page that holds them."""

    tokens: tuple[int, ...]
    page: int | None
    parent: "PageNode | None"
    depth: int  # full pages from the root through this node (0 for the root)
    children: dict[tuple[int, ...], "PageNode"] = field(default_factory=dict)
    snapshots: list["Snapshot"] = field(default_factory=list)
    pins: int = 0  # sequences whose indexing cursor is here: never evicted while pinned
    hits: int = 0
    last_used: int = 0
    version: int = 0
    removed: bool = False
    salt: str | None = None  # the cache salt of the tree it belongs to (None: the unsalted tree)
    key: int = 0  # the salt and the tokens from the start through this page (chain_key; root_key for a root)


@dataclass(eq=False)
class Snapshot:
    """The recurrent state after ``node.depth * block_size + len(tail)`` tokens, in a state slot."""

    node: PageNode
    tail: tuple[int, ...]
    slot: int | None  # None for a model without recurrent state (a KV tail alone)
    tail_page: int | None  # the page holding the tail tokens' KV (None without a tail or without attention)
    block_size: int
    #: with a window page group: the window layers' pages of the blocks holding the last ``window`` positions
    #: before ``position`` (the last one partly filled unless ``position`` ends a block); a hit shares them
    window_pages: list[int] = field(default_factory=list)
    pins: int = 0  # hits being attached right now
    hits: int = 0
    last_used: int = 0
    version: int = 0
    removed: bool = False

    @property
    def position(self) -> int:
        return self.node.depth * self.block_size + len(self.tail)


@dataclass
class PrefixMatch:
    """What the index holds of a token sequence."""

    path: list[PageNode]  # matched full pages, root excluded (path[i] holds tokens [i*bs, (i+1)*bs))
    kv_tokens: int  # tokens whose KV is cached: the divergence point, token-granular
    partial: "PageNode | Snapshot | None"  # holder of the page with kv_tokens beyond the path's full pages
    snapshot: Snapshot | None  # the longest usable snapshot (position <= the limit), or None


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixIndex:
    """The tree of cached pages and snapshots, and the queue of eviction candidates."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = PageNode((), None, None, 0, key=root_key(None))  # the unsalted requests' tree
        self._salted_roots: dict[str, PageNode] = {}  # one tree per cache salt that holds something
        self.num_nodes = 0  # roots excluded
        self.num_snapshots = 0
        self.clock = 0
        self._heap: list[tuple[float, int, int, int, PageNode | Snapshot]] = []
        self._order = itertools.count()

    # ------------------------------------------------------------------ roots
    def root_of(self, salt: str | None, create: bool = False) -> PageNode | None:
        """The root of ``salt``'s tree (made with ``create``; otherwise None if that salt holds nothing)."""
        if salt is None:
            return self.root
        root = self._salted_roots.get(salt)
        if root is None and create:
            root = self._salted_roots[salt] = PageNode((), None, None, 0, salt=salt, key=root_key(salt))
        return root

    def drop_root_if_empty(self, root: PageNode) -> None:
        """Forget a salted root that holds no page, no snapshot and no sequence's cursor."""
        if root.salt is not None and not root.children and not root.snapshots and not root.pins \
                and self._salted_roots.get(root.salt) is root:
            del self._salted_roots[root.salt]
            root.removed = True

    def other_roots(self, salt: str | None) -> list[PageNode]:
        """The roots of every tree but ``salt``'s (the unsalted one included when ``salt`` is set)."""
        roots = [root for key, root in self._salted_roots.items() if key != salt]
        return roots + [self.root] if salt is not None else roots

    @property
    def num_salts(self) -> int:
        """Cache salts whose tree holds something."""
        return len(self._salted_roots)

    # ------------------------------------------------------------------ match
    def match(self, tokens: list[int], limit: int, salt: str | None = None) -> PrefixMatch:
        """The cached pages along ``tokens`` and the longest snapshot at a position ``<= limit``, in ``salt``'s
        tree only."""
        bs = self.block_size
        root = self.root_of(salt)
        if root is None:
            return PrefixMatch([], 0, None, None)
        node, path, best = root, [], None
        while True:
            for snap in node.snapshots:
                pos = snap.position
                if pos <= limit and (best is None or pos > best.position) and \
                        list(snap.tail) == tokens[node.depth * bs:pos]:
                    best = snap
            start = node.depth * bs
            if start + bs > len(tokens):
                break
            child = node.children.get(tuple(tokens[start:start + bs]))
            if child is None:
                break
            path.append(child)
            node = child
        kv, longest = node.depth * bs, 0
        partial: PageNode | Snapshot | None = None
        rest = tokens[kv:kv + bs]
        if rest:
            for child in itertools.islice(node.children.values(), MAX_CHILDREN_SCANNED):
                n = _common_prefix(child.tokens, rest)
                if n > longest:
                    partial, longest = child, n
            for snap in node.snapshots:  # a snapshot's tail page holds its tail tokens' KV
                n = _common_prefix(snap.tail, rest)
                if n > longest and snap.tail_page is not None:
                    partial, longest = snap, n
        kv += longest
        return PrefixMatch(path, kv, partial, best)

    def snapshot_past(self, match: PrefixMatch, tokens: list[int]) -> int | None:
        """The position of the nearest snapshot on the cached branch ``tokens`` follow, past their divergence point
        (``match.kv_tokens``): where the state was saved on the prefix they share (None if none is found among
        :data:`MAX_NODES_SEARCHED` nodes). Reads only; nothing is touched."""
        bs, kv = self.block_size, match.kv_tokens
        found: list[int] = []
        if match.path:  # snapshots on the last matched page whose tails agree with the prompt to the divergence
            start = match.path[-1].depth * bs
            found = [s.position for s in match.path[-1].snapshots
                     if s.position > kv and list(s.tail[:kv - start]) == tokens[start:kv]]
        if isinstance(match.partial, Snapshot):
            found.append(match.partial.position)
        elif match.partial is not None:  # the page the prompt leaves inside: every snapshot below it is past kv
            stack, seen = [match.partial], 0
            while stack and seen < MAX_NODES_SEARCHED:
                node = stack.pop()
                seen += 1
                found.extend(s.position for s in node.snapshots)
                stack.extend(node.children.values())
        return min(found, default=None)

    # ----------------------------------------------------------------- update
    def add_child(self, node: PageNode, tokens: tuple[int, ...], page: int | None) -> PageNode:
        """A new node for ``tokens`` (``block_size`` of them) under ``node``, held in ``page``."""
        assert len(tokens) == self.block_size and tokens not in node.children
        child = PageNode(tokens, page, node, node.depth + 1, last_used=self.tick(), salt=node.salt,
                         key=chain_key(node.key, tokens))
        node.children[tokens] = child
        self.num_nodes += 1
        return child

    def find_snapshot(self, node: PageNode, tail: tuple[int, ...]) -> Snapshot | None:
        for snap in node.snapshots:
            if snap.tail == tail:
                return snap
        return None

    def add_snapshot(self, node: PageNode, tail: tuple[int, ...], slot: int | None,
                     tail_page: int | None) -> Snapshot:
        """Record a snapshot at ``node`` + ``tail`` held in ``slot`` (none there yet)."""
        assert len(tail) < self.block_size and self.find_snapshot(node, tail) is None
        snap = Snapshot(node, tail, slot, tail_page, self.block_size, last_used=self.tick())
        node.snapshots.append(snap)
        self.num_snapshots += 1
        return snap

    def remove_snapshot(self, snap: Snapshot) -> None:
        snap.node.snapshots.remove(snap)
        snap.removed = True
        self.num_snapshots -= 1

    def remove_leaf(self, node: PageNode) -> None:
        """Take out a node with no children and no snapshots."""
        assert node.parent is not None and not node.children and not node.snapshots
        del node.parent.children[node.tokens]
        node.removed = True
        self.num_nodes -= 1

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, item: PageNode | Snapshot) -> None:
        """Count a hit on ``item`` (its priority changes: push it again to requeue it)."""
        item.hits += 1
        item.last_used = self.tick()

    def items(self):
        """Every node (roots excluded) and every snapshot, of every salt's tree."""
        stack = [self.root, *self._salted_roots.values()]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            yield from node.snapshots
            stack.extend(node.children.values())

    # -------------------------------------------------------------- eviction
    def push(self, item: PageNode | Snapshot, value: float) -> None:
        """Queue ``item`` as an eviction candidate at ``value`` (lower goes first; ties: least recently used)."""
        item.version += 1
        heapq.heappush(self._heap, (value, item.last_used, next(self._order), item.version, item))

    def pop_victim(self, evictable: Callable[[PageNode | Snapshot], bool],
                   below: float | None = None) -> PageNode | Snapshot | None:
        """The lowest-value evictable candidate (below ``below`` when given), taken off the queue; None if none."""
        while self._heap:
            value, _, _, version, item = self._heap[0]
            if item.removed or version != item.version or not evictable(item):
                heapq.heappop(self._heap)
                continue
            if below is not None and value >= below:
                return None
            heapq.heappop(self._heap)
            return item
        return None

    def needs_rebuild(self) -> bool:
        return len(self._heap) > 4 * (self.num_nodes + self.num_snapshots) + 64

    def rebuild(self, value_of: Callable[[PageNode | Snapshot], float],
                evictable: Callable[[PageNode | Snapshot], bool]) -> None:
        """Drop stale queue entries: requeue every evictable item once."""
        self._heap = []
        for item in self.items():
            if evictable(item):
                self.push(item, value_of(item))
