"""Starting the ranks: worker processes on this host (torch.multiprocessing, forkserver), or, under a
torchrun-style launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the processes already running."""

from __future__ import annotations

import os
import socket
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from hybridserve.config import EngineConfig
from hybridserve.distributed.group import Endpoint, TensorParallelError, TPGroup

#: the environment of a torchrun-style launch
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Launch:
    """This process's rank and, on rank 0 of a one-host launch, the worker processes it started."""

    group: TPGroup
    processes: list = field(default_factory=list)  # rank r's process at r - 1 (empty under torchrun)

    def dead(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of every started worker that is no longer running."""
        return [(r + 1, p.exitcode) for r, p in enumerate(self.processes) if not p.is_alive()]

    def stop(self, grace: float = 5.0) -> None:
        """Ask the workers to stop, then end any still running after ``grace`` seconds."""
        _stop(self.processes, grace)


def _stop(processes: list, grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


def torchrun_rank(world: int) -> tuple[int, Endpoint] | None:
    """(rank, rank 0's endpoint) from a torchrun-style environment of ``world`` processes; None without one."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    missing = [name for name in LAUNCH_ENV if name not in os.environ]
    if missing:
        raise ValueError(f"a multi-process launch sets RANK and WORLD_SIZE but not {', '.join(missing)}")
    size = int(os.environ["WORLD_SIZE"])
    if size != world:
        raise ValueError(f"WORLD_SIZE={size} does not match tensor_parallel_size={world}")
    return int(os.environ["RANK"]), Endpoint(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def _context():
    """A forkserver whose server has imported the worker's modules once: each worker after the first starts
    in a fraction of a second, without re-importing torch (and never forks a process that ran OpenMP)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["hybridserve.distributed.preload"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: EngineConfig, startup_timeout: float = 600.0) -> Launch:
    """Join or start the ``config.tensor_parallel_size`` ranks. On rank 0 this returns once every rank is
    connected (TensorParallelError if a worker dies first); on another rank of a torchrun launch it serves
    rank 0 until told to stop and then exits the process."""
    world = config.tensor_parallel_size
    joined = torchrun_rank(world)
    if joined is not None:
        rank, endpoint = joined
        group = TPGroup(rank, world, endpoint)
        if rank != 0:
            from hybridserve.distributed.worker import serve_rank

            serve_rank(config, group)
            raise SystemExit(0)
        _await_workers(group, [], startup_timeout)
        return Launch(group)
    from hybridserve.distributed.worker import spawned_worker_main

    endpoint = Endpoint("127.0.0.1", _free_port())
    group = TPGroup(0, world, endpoint)
    ctx = _context()
    threads = max(1, torch.get_num_threads() // world)
    processes = []
    for rank in range(1, world):
        p = ctx.Process(target=spawned_worker_main, args=(rank, world, endpoint, config, threads), daemon=True,
                        name=f"hybridserve-tp{rank}")
        p.start()
        processes.append(p)
    weakref.finalize(group, _stop, processes, 0.0)  # a dropped engine takes its workers with it
    started = Launch(group, processes)
    try:
        _await_workers(group, started, startup_timeout)
    except BaseException:
        _stop(processes, 0.0)
        raise
    return started


def _await_workers(group: TPGroup, started: Launch | list, timeout: float) -> None:
    """Wait for every worker to reach the store (watching the started processes), then join the gloo group."""
    await_keys(group, "hello", started if isinstance(started, Launch) else None, timeout, "connect")
    group.connect()


def await_keys(group: TPGroup, key: str, started: Launch | None, timeout: float, what: str) -> dict[int, str]:
    """Every worker's ``{key}{rank}`` value, once each has set it; TensorParallelError when a started worker
    exits first (with what it left in the store) or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    waiting = set(range(1, group.world))
    while waiting:
        waiting = {r for r in waiting if not group.has_key(f"{key}{r}")}
        dead = started.dead() if started is not None else []
        if dead:
            raise TensorParallelError(failure_message(group, dead, "while starting"))
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not {what} within {timeout:.0f} s")
        if waiting:
            time.sleep(0.02)
    return {r: group.store.get(f"{key}{r}").decode() for r in range(1, group.world)}


def failure_message(group: TPGroup, dead: list[tuple[int, int | None]], when: str) -> str:
    """What went wrong on the workers: the ranks that exited and the errors they left."""
    parts = [f"tensor-parallel rank {r} exited {when} (exit code {code})" for r, code in dead]
    for rank, message in group.errors().items():
        parts.append(f"rank {rank} failed:\n{message.rstrip()}")
    return "; ".join(parts) if parts else "a tensor-parallel rank failed"
