"""Prefix caching for hybrid models: shared KV pages and recurrent-state snapshots in the one pool.

A request whose prompt begins with tokens the engine has run before resumes from the longest cached
prefix that has everything it needs:

* a model without recurrent state needs only the KV of that prefix: every full page is shared
  (reference-counted), a partly used last page is copied (copy on write), to the token;
* a model with recurrent state needs the KV *and* a **snapshot** of the state at exactly that
  position. Snapshots are state slots of the pool, in the state's own dtypes; a hit copies the
  snapshot's slot into the request's own slot (the state is rewritten in place at every token, so it
  is never shared).

Snapshots are taken where reuse is expected (:meth:`PrefixCache.plan`):

* at the end of every prompt (a copy of the request's slot), so the same prompt again, or a longer
  one that extends it, resumes there;
* at the end of every generation (the finished request's slot itself, no copy), so turn k+1 of a
  chat resumes from turn k's prompt and answer;
* at **branch points**: when a new request's KV matches further than any snapshot, its prefill
  stops at the divergence point once and snapshots there, so every later request sharing that
  prefix hits, however short it is (a 40-token shared prefix hits);
* every ``snapshot_interval`` tokens of a long prefill.

The scheduler ends prefill chunks at the planned positions (a chunk never runs past one), and
:meth:`PrefixCache.after_step` indexes every newly filled page and takes the due snapshots after a
successful step.

One budget. Cached pages and snapshots are live members of the pool, evictable whenever no request
holds them; an allocation for a request that does not fit evicts them first, so running requests
always win and a request is preempted only when nothing cached is left to evict. What goes first is
the lowest *value*: reuse count times the tokens of recompute it saves, per byte it holds
(``(1 + hits) * position / slot_bytes`` for a snapshot, ``(1 + hits) * block_size / page_bytes`` for a
page of a pure-attention model; a hybrid's KV page past every snapshot on its path saves no
recompute alone and goes first), least recently used among equals. A snapshot is only taken by
evicting items of lower value than its own; otherwise it is skipped (counted).

Sliding-window layers in a page group of their own (:mod:`hybridserve.cache.layout`) give back their pages
behind the window while a request runs, so the index's pages serve only the full layers. The cache keeps
only what it can restore: a snapshot also holds the window layers' pages of the last ``window`` positions
before it (``Snapshot.window_pages``), and a hit resumes from a snapshot alone (shares those pages and
copies the partly filled one); a model with window layers and no recurrent state gets no hits.
docs/sliding_window.md.

Tenants. A request's ``cache_salt`` (:mod:`hybridserve.cache.salt`) picks the index's tree it looks up and
fills: requests with different salts never share a page or a snapshot, and a branch point is only planned
for queued requests of the same salt; events are recorded for unsalted pages only.

With events on (:meth:`PrefixCache.enable_events`), every page added to the index or evicted from it is
recorded as a KV cache event for a router in front of several replicas (:mod:`hybridserve.cache.kv_events`,
docs/data_parallel.md).
"""

from __future__ import annotations

from hybridserve.cache.evicted_prefixes import EvictedPrefixes
from hybridserve.cache.kv_events import KVEventRecorder
from hybridserve.cache.page_ledger import PageLedger
from hybridserve.cache.prefix_eviction import PrefixEviction
from hybridserve.cache.prefix_hit import PrefixHit, PrefixStats
from hybridserve.cache.prefix_index import PageNode, PrefixIndex, PrefixMatch, Snapshot, chain_key, root_key
from hybridserve.cache.prefix_reason import PrefixCacheReason
from hybridserve.cache.prefix_sharing import follower_branch_points
from hybridserve.options import DEFAULT_SNAPSHOT_INTERVAL

__all__ = ["PrefixCache", "PrefixHit", "PrefixStats"]


class PrefixCache(PrefixEviction):
    """The prefix index over one pool: lookups, indexing, snapshots and eviction (:class:`PrefixEviction`).
    Its pages are counted in ``ledger``, the one the sequences' ``CacheManager`` counts theirs in; every page
    and slot here is a handle, which no compaction changes."""

    def __init__(self, ledger: PageLedger, snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL) -> None:
        self.ledger = ledger
        layout = ledger.pool.layout
        self.block_size = layout.block_size
        self.has_kv, self.has_state = layout.has_kv, layout.has_state
        self.window = layout.window  # the window page group's tokens, None without one
        self.page_bytes, self.slot_bytes = layout.page_bytes, layout.slot_bytes
        self.snapshot_interval = snapshot_interval
        self.index = PrefixIndex(self.block_size)
        self.stats = PrefixStats()
        self._node_by_page: dict[int, PageNode] = {}
        self._tails: dict[int, list[Snapshot]] = {}  # page -> snapshots holding it as their tail page
        self.evicted = EvictedPrefixes()
        #: the block events of the index's pages, for a router (None: not recorded; see enable_events)
        self.events: KVEventRecorder | None = None

    def enable_events(self) -> KVEventRecorder:
        """Record every page added to or taken out of the index from now on (:mod:`hybridserve.cache.kv_events`);
        call it before anything is cached."""
        if self.events is None:
            self.events = KVEventRecorder(self.block_size)
        return self.events

    # ---------------------------------------------------------------- lookup
    def lookup(self, seq, queued=()) -> PrefixHit:
        """The longest cached prefix ``seq`` (holding nothing yet) can resume from, and the snapshot
        positions to plan for it (``seq.snapshot_plan``), among them where the ``queued`` prompts leave its
        own (:mod:`hybridserve.cache.prefix_sharing`). A sequence that wants prompt logprobs gets no hit:
        it must compute every prompt position. The hit's ``reason`` says why it hit or not."""
        tokens = seq.all_token_ids
        limit = len(tokens) - 1  # the last token is always run: its logits are sampled
        salt = seq.params.cache_salt
        match = self.index.match(tokens, limit, salt)
        bs = self.block_size
        ineligible = None  # why this lookup cannot hit whatever is cached
        if seq.params.prompt_logprobs is not None:
            ineligible = PrefixCacheReason.PROMPT_LOGPROBS
        elif self.window is not None and not self.has_state:
            ineligible = PrefixCacheReason.CACHING_OFF  # window pages are restored from state snapshots alone
        if ineligible is not None:
            hit = PrefixHit(0, [], None, None)
        elif self.has_state:
            snap = match.snapshot
            n = snap.position if snap is not None else 0
            hit = PrefixHit(n, match.path[:n // bs], snap if n % bs and self.has_kv else None, snap)
        else:
            n = min(match.kv_tokens, limit)
            tail = None
            if n % bs:
                tail = match.path[n // bs] if n // bs < len(match.path) else match.partial
            hit = PrefixHit(n, match.path[:n // bs], tail, None)
        hit.kv_tokens, hit.num_tokens = min(match.kv_tokens, limit), len(tokens)
        hit.reason = ineligible or self._reason(tokens, limit, salt, match, hit)
        if hit.reason is PrefixCacheReason.NO_SNAPSHOT:
            hit.snapshot_past = self.index.snapshot_past(match, tokens)
        seq.snapshot_plan = self.plan(hit.tokens, hit.kv_tokens, len(seq.prompt_token_ids), len(tokens))
        if self.has_state and queued:
            seq.snapshot_plan = sorted({*seq.snapshot_plan, *follower_branch_points(seq, queued, hit.tokens)})
        return hit

    def _reason(self, tokens: list[int], limit: int, salt: str | None, match: PrefixMatch,
                hit: PrefixHit) -> PrefixCacheReason:
        """Why a lookup of ``tokens`` (``match`` in ``salt``'s tree) gave ``hit``. Reads other salts' trees for
        ``salted`` without touching them: no hit count, no recency, no eviction order changes."""
        if hit.tokens:
            return PrefixCacheReason.HIT
        if self._evicted_match(tokens, limit, salt, match):
            return PrefixCacheReason.EVICTED
        if hit.kv_tokens:
            return PrefixCacheReason.NO_SNAPSHOT
        if limit < self.block_size:
            return PrefixCacheReason.TOO_SHORT
        first = tuple(tokens[:self.block_size])
        if any(first in root.children for root in self.index.other_roots(salt)):
            return PrefixCacheReason.SALTED
        return PrefixCacheReason.NO_MATCH

    def _evicted_match(self, tokens: list[int], limit: int, salt: str | None, match: PrefixMatch) -> bool:
        """Whether a snapshot usable for ``tokens``, or the page that continues the matched path, was evicted
        lately (:mod:`hybridserve.cache.evicted_prefixes`; keys chained from ``salt``'s own root)."""
        if not len(self.evicted):
            return False
        bs = self.block_size
        root = self.index.root_of(salt)
        keys = [root.key if root is not None else root_key(salt)] + [node.key for node in match.path]
        matched = len(keys)
        while len(keys) * bs <= len(tokens):  # the keys of the pages past the matched ones, which are not cached now
            start = (len(keys) - 1) * bs
            keys.append(chain_key(keys[-1], tuple(tokens[start:start + bs])))
        if len(keys) > matched and self.evicted.has_page(keys[matched]):  # the page that continues the match
            return True
        return self.has_state and any(self.evicted.has_snapshot(key, tokens, depth * bs, limit, bs)
                                      for depth, key in enumerate(keys))

    def plan(self, start: int, kv_tokens: int, prompt_len: int, num_tokens: int) -> list[int]:
        """Positions after ``start`` where a snapshot is to be taken: the branch point ``kv_tokens``
        (where this sequence leaves what is cached), every ``snapshot_interval`` tokens, and the prompt's end."""
        if not self.has_state:
            return []
        points = set()
        if start < kv_tokens < num_tokens:
            points.add(kv_tokens)
        if self.snapshot_interval:
            k = self.snapshot_interval
            points.update(range((start // k + 1) * k, num_tokens, k))
        if start < prompt_len:
            points.add(prompt_len)
        return sorted(points)

    def count(self, hit: PrefixHit) -> None:
        """Count a lookup whose sequence was admitted."""
        self.stats.queries += hit.num_tokens
        self.stats.hits += hit.tokens
        if self.has_state and hit.kv_tokens > hit.tokens:
            self.stats.kv_beyond_snapshot += 1

    def attached(self, seq, hit: PrefixHit) -> None:
        """``seq`` now resumes from ``hit``: count the reuse and point its indexing cursor at the hit."""
        for node in hit.shared:
            self.index.touch(node)
            self._consider(node)
        for used in {id(x): x for x in (hit.snapshot, hit.tail) if isinstance(x, Snapshot)}.values():
            self.index.touch(used)
            self._consider(used)
        cursor = hit.snapshot.node if hit.snapshot is not None else (hit.shared[-1] if hit.shared else None)
        self._move_cursor(seq, cursor, len(hit.shared))

    def hold(self, hit: PrefixHit) -> None:
        """Keep the state snapshot an attach of ``hit`` copies out of eviction while it makes room (evicted, its
        slot could be the very one the attach is handed); :meth:`let_go` ends it. (The KV pages it reads are
        held by the attach's own references.)"""
        if hit.snapshot is not None:
            hit.snapshot.pins += 1

    def let_go(self, hit: PrefixHit, tail_page: int | None) -> None:
        """An attach of ``hit`` ended, done or not: its snapshot is unpinned, and what it kept from eviction
        meanwhile (its pages' references, ``tail_page``'s too) may be evictable again, while an eviction
        meanwhile may have dropped it from the queue."""
        if hit.snapshot is not None:
            hit.snapshot.pins -= 1
        for node in hit.shared:
            self._consider(node)
        if tail_page is not None:
            self.unheld([tail_page])  # the node holding it, if the page was filled and indexed since
        for snapshot in hit.snapshots():
            self._consider(snapshot)

    # -------------------------------------------------------------- indexing
    def after_step(self, seqs) -> None:
        """Index the pages each sequence has filled and take the snapshots now due (a successful step)."""
        for seq in seqs:
            if seq.is_finished:
                continue
            self.index_pages(seq)
            plan = seq.snapshot_plan
            while plan and plan[0] <= seq.num_computed_tokens:
                if plan.pop(0) == seq.num_computed_tokens:
                    self._snapshot(seq)

    def index_pages(self, seq) -> None:
        """Add ``seq``'s full computed pages to the index (its own page, unless one with its tokens is there)."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        i = seq.num_indexed_pages
        if i >= full:
            return
        node = seq.prefix_node or self.index.root_of(seq.params.cache_salt, create=True)
        assert node is not None  # (root_of creates it)
        while i < full:
            tokens = tuple(seq.token_ids_slice(i * bs, bs))
            child = node.children.get(tokens)
            if child is None:
                page = seq.block_table[i] if self.has_kv else None
                child = self.index.add_child(node, tokens, page)
                if page is not None:
                    self.ledger.ref(page)
                    self._node_by_page[page] = child
                if self.events is not None:
                    self.events.stored(child)
            node = child
            i += 1
        self._move_cursor(seq, node, i)

    def share_cursor(self, parent, child) -> None:
        """``child`` was forked from ``parent``: it continues indexing from the same page."""
        self._move_cursor(child, parent.prefix_node, parent.num_indexed_pages)

    def _move_cursor(self, seq, node: PageNode | None, num_pages: int) -> None:
        old = seq.prefix_node
        if old is not node:
            if node is not None:
                node.pins += 1
            if old is not None:
                old.pins -= 1
                self._consider(old)
        seq.prefix_node = node
        seq.num_indexed_pages = num_pages

    def release(self, seq, keep_state: bool) -> None:
        """``seq`` is about to give back its cache: with ``keep_state``, its state slot becomes the snapshot
        at its last computed token (the end of its generation); its indexing cursor is dropped."""
        if keep_state and self.has_state and seq.state_slot is not None and seq.num_computed_tokens > 0:
            self.index_pages(seq)
            snap = self._record(seq, seq.state_slot)
            if snap is not None:
                seq.state_slot = None  # the snapshot owns the slot now
        elif keep_state and not self.has_state and seq.num_computed_tokens % self.block_size:
            self.index_pages(seq)
            self._record(seq, None)  # its partly filled last page, for the next turn
        self._move_cursor(seq, None, 0)

    def unheld(self, pages: list[int]) -> None:
        """A sequence let go of ``pages``: the cached ones among them may have become evictable."""
        for page in pages:
            node = self._node_by_page.get(page)
            if node is not None:
                self._consider(node)

    def _snapshot(self, seq) -> None:
        """Copy ``seq``'s state (at its last computed token) into a new snapshot slot."""
        node, tail = self._where(seq)
        if node is None:
            return
        existing = self.index.find_snapshot(node, tail)
        if existing is not None:
            self.index.touch(existing)
            self._consider(existing)
            return
        done = seq.num_computed_tokens
        value = done / (self.slot_bytes + self._window_blocks(done) * self.page_bytes)  # as value() will have it
        if not self._evict_until(lambda: self.ledger.can_allocate(0, 1), below=value):
            self.stats.snapshots_skipped += 1
            self._consider(node)  # a salt's root made for this snapshot alone is dropped again
            return
        slot = self.ledger.allocate(0, 1).slots[0]
        self.ledger.copy_slot(seq.state_slot, slot)
        self._record(seq, slot)

    def _where(self, seq) -> tuple[PageNode | None, tuple[int, ...]]:
        """The node and tail tokens of a snapshot of ``seq`` at its last computed token (None if its pages
        are not indexed up to there)."""
        node = seq.prefix_node or self.index.root_of(seq.params.cache_salt, create=True)
        assert node is not None  # (root_of creates it)
        if node.depth != seq.num_computed_tokens // self.block_size:
            self._consider(node)  # (a salt's root made just now, holding nothing, is dropped again)
            return None, ()
        start = node.depth * self.block_size
        return node, tuple(seq.token_ids_slice(start, seq.num_computed_tokens - start))

    def _record(self, seq, slot: int | None) -> Snapshot | None:
        """Add the snapshot of ``seq``'s last computed token held in ``slot`` (None, nothing done, if the
        index already has one there or ``seq`` is not indexed up to it)."""
        node, tail = self._where(seq)
        if node is None or self.index.find_snapshot(node, tail) is not None:
            return None
        tail_page = seq.block_table[node.depth] if tail and self.has_kv else None
        if tail_page is not None:
            self.ledger.ref(tail_page)
        snap = self.index.add_snapshot(node, tail, slot, tail_page)
        if tail_page is not None:
            self._tails.setdefault(tail_page, []).append(snap)
        if self.window is not None and slot is not None:
            self._hold_window(snap, seq)
        if slot is not None:
            self.stats.snapshots_taken += 1
        self._consider(snap)
        return snap

    def _window_blocks(self, position: int) -> int:
        """Window-group pages a snapshot at ``position`` holds (0 without a window page group)."""
        if self.window is None:
            return 0
        return -(-position // self.block_size) - max(0, position - self.window + 1) // self.block_size

    def _hold_window(self, snap: Snapshot, seq) -> None:
        """``snap`` takes a reference to ``seq``'s window-group pages of the blocks holding the ``window``
        positions before it (all held by ``seq``: they are the ones its next token attends to)."""
        pos, bs = snap.position, self.block_size
        assert self.window is not None  # (called with a window page group only)
        first = max(0, pos - self.window + 1) // bs
        snap.window_pages = seq.window_table[first:-(-pos // bs)]
        for page in snap.window_pages:
            assert page >= 0, "a snapshot's window page was released"
            self.ledger.ref(page)

    def drop_all(self, seqs) -> None:
        """Give back everything the cache holds, whoever else holds it too (``seqs``: every sequence with a
        cursor or a plan), leaving the sequences' own references: the cache is then unused."""
        for seq in seqs:
            self._move_cursor(seq, None, 0)
            seq.snapshot_plan = []
        for item in list(self.index.items()):
            if isinstance(item, Snapshot):
                if item.slot is not None:
                    self.ledger.free_slot(item.slot)
                if item.tail_page is not None:
                    self.ledger.unref(item.tail_page)
                for page in item.window_pages:
                    self.ledger.unref(page)
            elif item.page is not None:
                self.ledger.unref(item.page)
            item.removed = True
        self.index = PrefixIndex(self.block_size)
        if self.events is not None:
            self.events.cleared()
        self._node_by_page.clear()
        self._tails.clear()

    # ----------------------------------------------------------------- stats
    @property
    def num_cached_pages(self) -> int:
        return len(self._node_by_page)

    @property
    def num_snapshots(self) -> int:
        """State snapshots held (a model without state keeps KV tails alone, which are not counted)."""
        return self.index.num_snapshots if self.has_state else 0

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.slot_bytes
