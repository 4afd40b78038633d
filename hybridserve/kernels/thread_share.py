"""Fewer compute threads while other processes take the cores (``cpu_adaptive_threads``).

When another process keeps a core busy, an engine thread that waits for its peers at a barrier waits
for a peer that is not running: a two-thread decode step beside one busy process took 2.25x its quiet
time on a 2-core AMD EPYC Zen 5 with the bounded wait policy, where one thread took 1.8x
(``docs/performance.md``, "Shared cores"). With ``cpu_adaptive_threads`` the engine estimates, between
steps, how many cores the rest of the machine wants on the CPUs this process may run on, and runs with
the threads left free, never fewer than half of its count: where the others want more than that,
spreading over every core is the larger share.

The estimate: the others' CPU time there (``/proc/stat`` for those CPUs, less this process's own), scaled
by how long this process's threads waited to run (``/proc/self/task/*/schedstat``): the scheduler shares
the cores out alike, so a thread of theirs that ran a fraction r of the time wanted the rest too, as ours
did. One busy neighbour reads as 1 core taken whether the engine runs one thread or two; two read as 2.

The count set by ``cpu_threads`` (or auto) is the ceiling; the engine returns to it when the others
leave. A change is logged at INFO with the load that caused it.

Off by default: thread counts decide how torch's own operators split their sums, so a run whose count
changes part-way may differ in the last bits from a run that kept it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: seconds between two readings of the machine's load (CPU times tick 100 times a second on Linux)
INTERVAL_S = 0.2
#: a core counts as taken when the others used more than this share of it over an interval
TAKEN_SHARE = 0.6


def threads_for(ceiling: int, others: float, cores: int | None = None) -> int:
    """The thread count for ``others`` cores taken by the rest of the machine among this process's ``cores``
    (default ``ceiling``; more where some are reserved for the front end): the free cores up to ``ceiling``, but
    never fewer than half of ``ceiling`` (then all of it)."""
    taken = math.floor(max(0.0, others) + 1.0 - TAKEN_SHARE)
    free = min(ceiling, (ceiling if cores is None else cores) - taken)
    return free if free >= max(1, -(-ceiling // 2)) else ceiling


def busy_ticks(cpus: set[int], stat_text: str) -> int:
    """Non-idle clock ticks of ``cpus`` in /proc/stat's text (user, nice, system, irq, softirq, steal)."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        total += user + nice + system + irq + softirq + steal
    return total


def _read_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def own_times() -> tuple[float, float]:
    """(CPU seconds, seconds waiting in a run queue) summed over this process's threads; the waits are 0.0
    where the kernel keeps no schedstat."""
    run = wait = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/schedstat") as f:
                    fields = f.read().split()
            except OSError:  # the thread ended meanwhile
                continue
            run, wait = run + int(fields[0]), wait + int(fields[1])
    except (OSError, IndexError, ValueError):
        t = os.times()
        return t.user + t.system, 0.0
    return run / 1e9, wait / 1e9


class ThreadShare:
    """Decides the thread count between steps. ``poll()`` returns a new count when it should change, else None.
    ``ceiling``: the engine's thread count; ``cores``: the cores this process may use (the ceiling plus any left
    to the front end); ``cpus``: the CPUs whose load counts (default: this process's affinity).

    ``read_stat``, ``own`` (:func:`own_times`) and ``clock`` are the sources (replaced in tests)."""

    def __init__(self, ceiling: int, cores: int | None = None, cpus: set[int] | None = None, *,
                 read_stat: Callable[[], str] = _read_stat, own: Callable[[], tuple[float, float]] = own_times,
                 clock: Callable[[], float] = time.monotonic, ticks_per_second: float | None = None) -> None:
        self.ceiling, self.cores = ceiling, cores
        self.current = ceiling
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self._read_stat, self._own, self._clock = read_stat, own, clock
        self._hz = ticks_per_second or float(os.sysconf("SC_CLK_TCK"))
        self.others = 0.0  # cores the rest of the machine wanted over the last interval
        self.changes = 0
        self._last = self._sample()
        logger.info("CPU threads adapt to other processes: up to %d, fewer while the others want some of this "
                    "process's %d CPUs (cpu_adaptive_threads)", ceiling, len(self.cpus))

    def _sample(self) -> tuple[float, int, float, float]:
        return (self._clock(), busy_ticks(self.cpus, self._read_stat()), *self._own())

    def poll(self) -> int | None:
        """Read the load when an interval has passed; the new thread count if it changes, else None."""
        if self._clock() - self._last[0] < INTERVAL_S:
            return None
        now = self._sample()
        wall = now[0] - self._last[0]
        busy = (now[1] - self._last[1]) / self._hz
        ran, waited = max(0.0, now[2] - self._last[2]), max(0.0, now[3] - self._last[3])
        self._last = now
        ran_share = ran / (ran + waited) if ran > 0.0 else 1.0  # of the time our threads wanted a core
        self.others = max(0.0, (busy - ran) / wall) / ran_share
        want = threads_for(self.ceiling, self.others, self.cores)
        if want == self.current:
            return None
        logger.info("CPU threads %d -> %d: other processes wanted %.1f of this process's %d CPUs over the last %.2f s",
                    self.current, want, self.others, len(self.cpus), wall)
        self.current = want
        self.changes += 1
        return want
