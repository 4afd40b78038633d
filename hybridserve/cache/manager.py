"""Per-sequence cache holdings: a KV block table and one state slot, drawn from the pool.

Every page and slot a sequence holds is a handle of the pool (:mod:`hybridserve.cache.handle_map`): it
stays valid while held, whatever the pool compacts, so nothing here follows the pool's moves.

Pages are reference-counted in one :class:`~hybridserve.cache.page_ledger.PageLedger` (``page_refs``): a
sequence holds one reference to each page of its block table, and the prefix cache
(:mod:`hybridserve.cache.prefix_cache`, which holds the ledger, not the manager) one to each page it has
indexed or keeps as a snapshot's tail. A page goes back to the pool when its last reference goes. Pages are
only ever shared when full (every position written, never written again); a partly filled page is
copied (copy on write), so a sequence never writes into a page anyone else reads.

With a window page group (sliding-window layers beside full ones, :mod:`hybridserve.cache.layout`), a
sequence also holds ``window_table``, the window layers' pages, one per block like ``block_table``; the
pages wholly behind the window of its next token go back to the pool after every step
(:meth:`CacheManager.release_behind_window`), their entries set to -1. docs/sliding_window.md.
"""

from __future__ import annotations

from hybridserve.cache.capacity import fits, pages_for
from hybridserve.cache.holdings import CacheHolder, window_hit
from hybridserve.cache.kv_events import KVEventRecorder
from hybridserve.cache.page_ledger import PageLedger, decrement_ref
from hybridserve.cache.pool import Allocation, CachePool
from hybridserve.cache.prefix_cache import PrefixCache, PrefixHit
from hybridserve.cache.prefix_reason import PrefixCacheInfo, PrefixCacheReason, ReasonCounts
from hybridserve.cache.verification_slots import VerificationSlots
from hybridserve.options import DEFAULT_SNAPSHOT_INTERVAL

__all__ = ["CacheHolder", "CacheManager"]


class CacheManager(VerificationSlots):
    """Grants and releases each sequence's pages and slot, shares pages by reference; never leaks.

    With ``prefix_caching``, a new sequence resumes from the longest cached prefix
    (:meth:`admit`), and whatever the cache holds is evicted before any allocation fails.
    """

    def __init__(self, pool: CachePool, prefix_caching: bool = False,
                 snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size
        self._holders: dict[int, CacheHolder] = {}  # id(seq) -> seq, for every sequence holding anything
        self.ledger = PageLedger(pool)  # page -> references (sequences, and the prefix cache)
        self.page_refs = self.ledger.refs
        self.seq_page_refs: dict[int, int] = {}  # page -> references of sequences alone
        self.window = pool.layout.window  # tokens the window page group keeps, None without one
        self.window_pages_released = 0  # window-group pages given back behind running sequences' windows
        self._verifying: set[int] = set()  # id(seq) of the sequences verifying drafts on their speculative slot now
        self.prefix = PrefixCache(self.ledger, snapshot_interval) if prefix_caching else None
        self.answers = ReasonCounts()  # admissions of sequences holding nothing, by prefix-cache reason

    def pages_for(self, num_tokens: int) -> int:
        """KV pages needed to hold ``num_tokens`` tokens (0 for a model without attention)."""
        return pages_for(self.pool.layout, num_tokens)

    def needs(self, seq: CacheHolder, num_new_tokens: int) -> tuple[int, int]:
        """(pages, slots) still to be granted for ``seq`` to run ``num_new_tokens`` more tokens (pages of
        both page groups)."""
        full, window = self._page_needs(seq, num_new_tokens)
        slots = 1 if self.pool.layout.has_state and seq.state_slot is None else 0
        return full + window, slots

    def _page_needs(self, seq: CacheHolder, num_new_tokens: int) -> tuple[int, int]:
        """(full-group pages, window-group pages) ``seq`` still needs for ``num_new_tokens`` more tokens."""
        target = self.pages_for(seq.num_computed_tokens + num_new_tokens)
        full = max(0, target - len(seq.block_table))
        return full, (max(0, target - len(seq.window_table)) if self.window is not None else 0)

    def release_behind_window(self, seq: CacheHolder) -> int:
        """Give back ``seq``'s window-group pages wholly behind the window of its next token (position
        ``num_computed_tokens``, which attends to the ``window`` positions ending at itself): every page
        before the one holding position ``num_computed_tokens - window + 1``. Returns how many."""
        if self.window is None:
            return 0
        table = seq.window_table
        first = min(len(table), max(0, seq.num_computed_tokens - self.window + 1) // self.block_size)
        freed = []
        i = first - 1
        while i >= 0 and table[i] >= 0:  # released entries are a prefix: stop at the first one
            freed.append(table[i])
            table[i] = -1
            i -= 1
        for page in freed:
            self._seq_unref(page)
        self.window_pages_released += len(freed)
        return len(freed)

    def window_pages_held(self, seq: CacheHolder) -> int:
        """Window-group pages ``seq`` holds now (0 without a window page group)."""
        return sum(1 for page in seq.window_table if page >= 0) if self.window is not None else 0

    def make_room(self, num_pages: int, num_slots: int) -> bool:
        """Whether ``num_pages`` pages and ``num_slots`` slots fit, evicting cached prefixes if they must."""
        if self.pool.can_allocate(num_pages, num_slots):
            return True
        if self.prefix is not None and self.prefix.evict_for(num_pages, num_slots):
            return True
        return self.reclaim_spec_slots() and self.pool.can_allocate(num_pages, num_slots)

    def grant(self, seq: CacheHolder, num_new_tokens: int) -> bool:
        """Grant what ``seq`` needs for ``num_new_tokens`` more tokens; False (nothing granted) if it does not fit.

        Cached prefixes are evicted first if they must; the pool may compact to make room (no handle changes).
        """
        self.release_behind_window(seq)
        full, window = self._page_needs(seq, num_new_tokens)
        slots = 1 if self.pool.layout.has_state and seq.state_slot is None else 0
        if not full and not window and not slots:
            return True
        if not self.make_room(full + window, slots):
            return False
        self.allocate_for(seq, full, slots, window)
        return True

    def admit(self, seq, budget: int, queued=()) -> int:
        """Grant a waiting sequence its next chunk of at most ``budget`` tokens; the tokens to run (0: it does
        not fit, nothing granted). A sequence that holds nothing resumes from the longest cached prefix, and
        plans snapshots where the ``queued`` prompts leave its own. Each admission of a sequence holding nothing
        is answered (:meth:`_answer`)."""
        fresh = not (seq.block_table or seq.state_slot is not None or seq.num_computed_tokens)
        if self.prefix is None or not fresh:
            n = self.chunk(seq, min(seq.num_pending_tokens, budget))
            n = n if self.grant(seq, n) else 0
            if n and fresh:
                self._answer(seq, PrefixCacheReason.CACHING_OFF, seq.num_tokens, PrefixCacheInfo(
                    PrefixCacheReason.CACHING_OFF, 0))
            return n
        hit = self.prefix.lookup(seq, queued)
        if hit.tokens:
            n = self._attach(seq, hit, budget)
        else:
            n = self.chunk(seq, min(seq.num_pending_tokens, budget))
            n = n if self.grant(seq, n) else 0
        if n:
            self.prefix.count(hit)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit.tokens
            snapshot = hit.snapshot.position if hit.snapshot is not None else None
            self._answer(seq, hit.reason, hit.num_tokens,
                         PrefixCacheInfo(hit.reason.told(), hit.tokens, hit.kv_tokens, snapshot, hit.snapshot_past))
        return n

    def _answer(self, seq, reason: PrefixCacheReason, num_tokens: int, info: PrefixCacheInfo) -> None:
        """Count an admission's lookup under its ``reason`` (``salted`` included), and keep the first ``info`` (what
        the request is told: never ``salted``) on ``seq``."""
        self.answers.add(reason, num_tokens)
        if seq.prefix_cache is None:
            seq.prefix_cache = info

    def _attach(self, seq, hit: PrefixHit, budget: int) -> int:
        """Give ``seq`` the hit's pages (shared), a copy of its partly used page and of its snapshot."""
        prefix = self.prefix
        assert prefix is not None  # (a hit comes from the prefix cache)
        start = hit.tokens
        shared = [node.page for node in hit.shared if node.page is not None]
        pages = list(shared)  # every page it shares, of both groups
        for page in pages:  # the sequence's own references; they also keep eviction off them
            self._seq_ref(page)
        tail = hit.tail_page()
        if tail is not None:
            self.ref_page(tail)  # kept from eviction while the room is made
        n = self.chunk(seq, min(seq.num_tokens - start, budget), start)
        need_pages = self.pages_for(start + n) - len(pages)
        need_slots = 1 if self.pool.layout.has_state else 0
        first, need_window = 0, 0
        window_shared: list[int] = []
        partial: int | None = None
        if self.window is not None:  # the window layers' pages come from the snapshot (prefix_cache.PrefixHit)
            first, window_shared, partial = window_hit(hit, self.window, self.block_size)
            for page in window_shared:
                pages.append(page)
                self._seq_ref(page)
            need_window = self.pages_for(start + n) - first - len(window_shared)
        prefix.hold(hit)  # its snapshots, until let_go below
        try:
            if not self.make_room(need_pages + need_window, need_slots):
                for page in pages:
                    self._seq_unref(page)
                return 0
            got = self.allocate_raw(need_pages + need_window, need_slots)
            seq.block_table = shared + got.pages[:need_pages]
            seq.state_slot = got.slots[0] if got.slots else None
            self._holders[id(seq)] = seq
            if self.window is not None:
                seq.window_table = [-1] * first + window_shared + got.pages[need_pages:]
                if partial is not None:
                    self.copy_page(partial, got.pages[need_pages])
            if tail is not None:
                self.copy_page(tail, got.pages[0])
            if hit.snapshot is not None:
                assert hit.snapshot.slot is not None and seq.state_slot is not None  # (a state snapshot's)
                self.copy_slot(hit.snapshot.slot, seq.state_slot)
        finally:
            if tail is not None:
                self.unref_page(tail)
            prefix.let_go(hit, tail)
        seq.num_computed_tokens = start
        prefix.attached(seq, hit)
        return n

    def chunk(self, seq, n: int, start: int | None = None) -> int:
        """``n`` cut so the chunk from ``start`` (its computed tokens) ends at its next planned snapshot."""
        start = seq.num_computed_tokens if start is None else start
        for point in seq.snapshot_plan:
            if point > start:
                return min(n, point - start)
        return n

    def fork(self, parent: CacheHolder, child: CacheHolder) -> bool:
        """Give ``child`` (holding nothing) the cache of ``parent``'s computed tokens: its full pages shared,
        its partly filled last page and its state copied. False, nothing granted, if it does not fit."""
        done = parent.num_computed_tokens
        full = done // self.block_size if self.pool.layout.has_kv else 0
        partial = 1 if self.pool.layout.has_kv and done % self.block_size else 0
        slots = 1 if self.pool.layout.has_state else 0
        shared = parent.block_table[:full]
        window_partial = partial if self.window is not None else 0
        if self.window is not None:  # its window pages too (those not released), the partly filled one copied
            shared = shared + [page for page in parent.window_table[:full] if page >= 0]
        for page in shared:
            self._seq_ref(page)  # held from now on, so eviction cannot take them
        if not self.make_room(partial + window_partial, slots):
            for page in shared:
                self._seq_unref(page)
            return False
        got = self.allocate_raw(partial + window_partial, slots)
        child.block_table = parent.block_table[:full] + got.pages[:partial]
        if partial:
            self.copy_page(parent.block_table[full], got.pages[0])
        if self.window is not None:
            child.window_table = parent.window_table[:full] + got.pages[partial:]
            if window_partial:
                self.copy_page(parent.window_table[full], got.pages[partial])
        if slots:
            child.state_slot = got.slots[0]
            assert parent.state_slot is not None  # (a model with state: the parent holds its slot)
            self.copy_slot(parent.state_slot, child.state_slot)
        child.num_computed_tokens = done
        self._holders[id(child)] = child
        if self.prefix is not None:
            self.prefix.share_cursor(parent, child)
        return True

    def allocate_for(self, seq: CacheHolder, pages: int, slots: int, window_pages: int = 0) -> Allocation:
        """Give ``seq`` ``pages`` more KV pages, ``window_pages`` more window-group pages and, with ``slots=1``,
        its state slot.

        Every allocation for a sequence goes through here or :meth:`allocate_raw` (never ``pool.allocate``
        directly), which count its pages' references. Raises
        :class:`~hybridserve.cache.pool.OutOfCacheError` (nothing changed) when they do not fit.
        """
        got = self.allocate_raw(pages + window_pages, slots)
        if got.slots:
            seq.state_slot = got.slots[0]
        seq.block_table.extend(got.pages[:pages])
        if window_pages:
            seq.window_table.extend(got.pages[pages:])
        self._holders[id(seq)] = seq
        return got

    def allocate_raw(self, pages: int, slots: int) -> Allocation:
        """Pages (one reference each, a sequence's) and slots from the pool, for their caller to hold."""
        got = self.ledger.allocate(pages, slots)
        for page in got.pages:
            self.seq_page_refs[page] = 1
        return got

    def _seq_ref(self, page: int) -> None:
        self.page_refs[page] += 1
        self.seq_page_refs[page] = self.seq_page_refs.get(page, 0) + 1

    def _seq_unref(self, page: int) -> None:
        decrement_ref(self.seq_page_refs, page)
        self.unref_page(page)

    def held_bytes(self) -> int:
        """Pool bytes held by sequences: their pages (a shared page once) and slots, cached prefixes aside."""
        layout = self.pool.layout
        snapshots = self.prefix.num_snapshots if self.prefix is not None else 0
        return len(self.seq_page_refs) * layout.page_bytes + (self.pool.num_live_slots - snapshots) * layout.slot_bytes

    def usage(self) -> float:
        """Fraction of the pool held by sequences (cached prefixes, which any allocation may evict, aside)."""
        return self.held_bytes() / self.pool.num_bytes if self.pool.num_bytes else 0.0

    def cached_bytes(self) -> int:
        """Pool bytes held only by the prefix cache (evictable)."""
        return self.pool.used_bytes() - self.held_bytes()

    def ref_page(self, page: int) -> None:
        """One more reference to ``page``."""
        self.ledger.ref(page)

    def unref_page(self, page: int) -> None:
        """Drop one reference to ``page``; the last one returns it to the pool."""
        self.ledger.unref(page)

    def free_slot(self, slot: int) -> None:
        """Return ``slot`` to the pool."""
        self.pool.free_slot(slot)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src`` onto ``dst``."""
        self.pool.copy_page(src, dst)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy state slot ``src`` onto ``dst``."""
        self.pool.copy_slot(src, dst)

    def after_step(self, seqs: list) -> None:
        """A step over ``seqs`` succeeded: index their filled pages and take their due snapshots."""
        if self.prefix is not None:
            self.prefix.after_step(seqs)
        if self.window is not None:
            for seq in seqs:
                if not seq.is_finished:
                    self.release_behind_window(seq)

    def release(self, seq: CacheHolder, keep_state: bool = False) -> None:
        """Return everything ``seq`` holds (with prefix caching and ``keep_state``, its state becomes a
        snapshot at its last computed token, and its indexed pages stay cached)."""
        if self.prefix is not None and hasattr(seq, "prefix_node"):
            self.prefix.release(seq, keep_state)
        pages, seq.block_table = seq.block_table, []
        window_pages: list[int] = []
        if self.window is not None:
            window_pages, seq.window_table = [page for page in seq.window_table if page >= 0], []
        for page in pages + window_pages:
            self._seq_unref(page)
        if self.prefix is not None:
            self.prefix.unheld(pages)
        if seq.state_slot is not None:
            self.pool.free_slot(seq.state_slot)
            seq.state_slot = None
        self.release_spec_slot(seq)
        self._holders.pop(id(seq), None)

    def reset_prefix_cache(self) -> bool:
        """Evict every cached prefix no request holds; True if nothing cached is left."""
        return self.prefix.clear() if self.prefix is not None else True

    @property
    def prefix_caching(self) -> bool:
        """Whether prefixes are cached (on unless turned off, or dropped after an internal error)."""
        return self.prefix is not None

    def enable_prefix_events(self) -> KVEventRecorder | None:
        """Record the prefix cache's block events from now on; None with prefix caching off."""
        return self.prefix.enable_events() if self.prefix is not None else None

    def drop_prefix_cache(self, seqs: list) -> None:
        """Stop caching prefixes for good, forgetting what ``seqs`` (every live sequence) hold of the cache."""
        if self.prefix is not None:
            self.prefix.drop_all(seqs)
            self.prefix = None

    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counters (``PrefixStats``) and sizes: snapshots and their bytes, cached pages and
        the bytes held only by the cache, zeros when it is off; and its answers by reason, ``lookups:REASON`` and
        ``queries:REASON`` (prompt tokens), ``salted`` included (``ReasonCounts``)."""
        names = ("queries", "hits", "kv_beyond_snapshot", "snapshots_taken", "snapshots_skipped",
                 "evicted_pages", "evicted_snapshots")
        prefix = self.prefix
        if prefix is None:
            return {**dict.fromkeys((*names, "snapshots", "snapshot_bytes", "cached_pages", "cached_bytes"), 0),
                    **self.answers.as_stats()}
        stats = {name: getattr(prefix.stats, name) for name in names}
        stats.update(self.answers.as_stats())
        stats.update(snapshots=prefix.num_snapshots, snapshot_bytes=prefix.snapshot_bytes,
                     cached_pages=prefix.num_cached_pages, cached_bytes=self.cached_bytes())
        return stats

    def fits_at_all(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits in a pool holding nothing else. A window page
        group counts every page too: a prompt prefilled in one chunk holds them all at once."""
        pool = self.pool
        groups = 2 if self.window is not None else 1
        return fits(pool.layout, pool.geometry, groups * self.pages_for(num_tokens),
                    1 if pool.layout.has_state else 0)

