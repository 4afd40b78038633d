"""The second state slot a speculative verification runs on (``CacheHolder.spec_slot``): granted when a step
verifies drafts, swapped with the state slot when every draft is accepted, reclaimed between steps when a
request needs the room (docs/spec_decode.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from hybridserve.cache.holdings import CacheHolder
from hybridserve.cache.pool import Allocation, CachePool


class VerificationSlots(ABC):
    """The speculative slots of the sequences a ``CacheManager`` holds (a base of it, which sets the
    attributes and provides the methods declared here)."""

    pool: CachePool
    _holders: dict[int, CacheHolder]
    _verifying: set[int]  # id(seq) of the sequences verifying drafts on their speculative slot now

    @abstractmethod
    def make_room(self, num_pages: int, num_slots: int) -> bool:
        """Whether the pages and slots fit, evicting cached prefixes if they must (``CacheManager``'s)."""

    @abstractmethod
    def allocate_raw(self, pages: int, slots: int) -> Allocation:
        """Pages and slots from the pool, their pages counted (``CacheManager``'s)."""

    @abstractmethod
    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the state slot ``src`` onto ``dst`` (``CacheManager``'s)."""

    def reclaim_spec_slots(self) -> bool:
        """Free every sequence's speculative slot but those of this step's verifications (between steps it is
        scratch: a verification copies the state onto it first); True if any was freed. Room a request needs
        comes before any speculation."""
        holders = [seq for key, seq in self._holders.items()
                   if getattr(seq, "spec_slot", None) is not None and key not in self._verifying]
        for seq in holders:
            self.release_spec_slot(seq)
        return bool(holders)

    def grant_spec_slot(self, seq: CacheHolder) -> bool:
        """Give ``seq`` (holding its state slot) a second slot for speculative verification, unless it has
        one; False, nothing granted, when the pool has no room for it (cached prefixes are evicted first,
        no sequence is preempted for it)."""
        if not self.pool.layout.has_state or getattr(seq, "spec_slot", None) is not None:
            return True
        if not self.make_room(0, 1):
            return False
        seq.spec_slot = self.allocate_raw(0, 1).slots[0]
        return True

    def release_spec_slot(self, seq: CacheHolder) -> None:
        """Return ``seq``'s speculative slot, if it holds one."""
        slot = getattr(seq, "spec_slot", None)
        self._verifying.discard(id(seq))
        if slot is not None:
            self.pool.free_slot(slot)
            seq.spec_slot = None

    def begin_verification(self, seq: CacheHolder) -> None:
        """Copy ``seq``'s state onto its speculative slot, which the verification then advances; the state
        slot keeps the state before the drafts."""
        if seq.spec_slot is not None:
            assert seq.state_slot is not None, "a verification runs on a sequence holding its state slot"
            self.copy_slot(seq.state_slot, seq.spec_slot)
            self._verifying.add(id(seq))

    def end_verification(self, seq: CacheHolder, all_accepted: bool) -> None:
        """Every draft was accepted: the speculative slot, past them all, becomes the state slot (and the
        old one the next verification's). Otherwise the state slot, before the drafts, stays."""
        self._verifying.discard(id(seq))
        if all_accepted and seq.spec_slot is not None:
            seq.state_slot, seq.spec_slot = seq.spec_slot, seq.state_slot
