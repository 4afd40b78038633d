"""A fair share of sequence slots between the callers of one engine.

An **origin** is one caller's submission: the sequences of one ``LLMEngine.add_requests`` call, that is one
HTTP request (every prompt of it and each prompt's ``n`` completions) or one ``LLM.generate`` call. While
sequences of more than one origin are held, no origin should take every one of the ``max_num_seqs`` slots
and leave the others waiting; with one origin alone, it takes them all, as before.

The rule, with ``share = max(1, max_num_seqs // active origins)`` (active: an origin with a sequence waiting
or running):

- **New slots.** A sequence may take a free slot (joining from the queue, or a fork child of ``n > 1``)
  unless its origin already runs ``share`` sequences or more while a sequence of another origin waits.
- **A starved origin.** When every slot is taken and an origin waits with nothing running, the youngest
  sequence of the origin running the most is preempted (recomputed later, as any preempted sequence), if that
  origin runs more than its share: one slot per starved origin, so a small request arriving behind a huge one
  starts at the next step. Running sequences are never preempted just to even out shares; those converge as
  sequences finish and their slots go to the origins below their share.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable

from hybridserve.engine.sequence import Sequence


class ShareView:
    """One step's view: the running sequences of each origin, the origins with sequences waiting, the share."""

    def __init__(self, running: Counter, waiting: set, max_num_seqs: int) -> None:
        self.running = running
        self.waiting = waiting
        self.share = max(1, max_num_seqs // max(1, len(set(running) | waiting)))

    def others_wait(self, origin: Hashable) -> bool:
        """Whether a sequence of an origin other than ``origin`` waits."""
        return len(self.waiting) > 1 or (len(self.waiting) == 1 and origin not in self.waiting)

    def room(self, origin: Hashable, free: int) -> int:
        """How many of ``free`` slots ``origin`` may take now."""
        if not self.others_wait(origin):
            return free
        return max(0, min(free, self.share - self.running[origin]))

    def took(self, origin: Hashable) -> None:
        """``origin`` took a slot."""
        self.running[origin] += 1


class OriginLedger:
    """How many sequences of each origin the scheduler holds, waiting or running (counted as they enter and
    leave, so a step's view costs the running sequences and the origins, never the length of the queue)."""

    def __init__(self) -> None:
        self._held: Counter = Counter()
        self._origin_of: dict[int, Hashable] = {}  # id(sequence) -> its origin, while held

    def __len__(self) -> int:
        """The origins with a sequence held."""
        return len(self._held)

    def enter(self, seq: Sequence) -> None:
        if id(seq) not in self._origin_of:
            self._origin_of[id(seq)] = seq.origin
            self._held[seq.origin] += 1

    def leave(self, seq: Sequence) -> None:
        origin = self._origin_of.pop(id(seq), None)
        if origin is None:
            return
        self._held[origin] -= 1
        if not self._held[origin]:
            del self._held[origin]

    def view(self, running: Iterable[Sequence], max_num_seqs: int) -> ShareView:
        counts = Counter(seq.origin for seq in running)
        waiting = {origin for origin, held in self._held.items() if held > counts[origin]}
        return ShareView(counts, waiting, max_num_seqs)


def starvation_victims(view: ShareView, running: list[Sequence]) -> list[Sequence]:
    """The running sequences to preempt so that every origin waiting with nothing running gets one slot (see the
    module docstring): for each, the youngest sequence of the origin running the most, while that origin runs
    more than its share. ``view`` is updated as if they were preempted."""
    starved = [origin for origin in view.waiting if view.running[origin] == 0]
    victims: list[Sequence] = []
    for _ in starved:
        biggest, count = max(view.running.items(), key=lambda kv: kv[1], default=(None, 0))
        if count <= view.share:
            break
        victim = max((seq for seq in running if seq.origin == biggest and seq not in victims),
                     key=lambda seq: (seq.arrival, seq.index))
        victims.append(victim)
        view.running[biggest] -= 1
    return victims
