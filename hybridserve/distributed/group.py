"""The tensor-parallel group of one engine: a TCP store for rank 0's step commands and a gloo process
group for the collectives inside a forward. No global state: every layer that communicates holds the
group it was sharded for."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: a collective (or a command read) that waits longer than this fails the engine instead of hanging
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
#: how long a worker waits for the next command before it checks that rank 0 is still there
POLL_TIMEOUT = timedelta(seconds=2)


@dataclass
class RankGeometry:
    """Rank and world size alone: enough to shard a meta model for a check (nothing runs on it)."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a model sharded by rank geometry alone is for checks: it does not run")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died: the engine cannot go on (the ranks' states diverged)."""


@dataclass
class Endpoint:
    """Where rank 0's store listens (MASTER_ADDR / MASTER_PORT in a torchrun-style launch)."""

    host: str
    port: int


class TPGroup:
    """Rank ``rank`` of ``world`` ranks: collectives over the gloo group, commands through the store."""

    def __init__(self, rank: int, world: int, endpoint: Endpoint, timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
        """Opens the store (rank 0 serves it); :meth:`connect` then joins the gloo group."""
        self.rank, self.world, self.timeout = rank, world, timeout
        # under torchrun the agent may already serve the store at MASTER_PORT: then every rank is a client
        serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        raw = dist.TCPStore(endpoint.host, endpoint.port, world, serves, timeout=timeout, wait_for_workers=False)
        self.store = dist.PrefixStore("hybridserve", raw)  # apart from the keys of any other user of the store
        self.pg: dist.ProcessGroupGloo | None = None
        self._sent = 0  # commands rank 0 has posted
        self._read = 0  # commands this worker has read

    def connect(self) -> None:
        """Join the gloo group (blocks until every rank has joined)."""
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", self.store), self.rank, self.world, self.timeout)

    def has_key(self, key: str) -> bool:
        return self.store.check([key])

    # ----------------------------------------------------------- collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (a copy first when it is not contiguous); returns the sum."""
        if self.world == 1:
            return t
        if not t.is_contiguous():
            t = t.contiguous()
        self.pg.allreduce([t]).wait()
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """(..., n) per rank -> (..., world * n): the ranks' tensors side by side along the last dim."""
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        self.pg.allgather([outs], [t]).wait()
        return torch.cat(outs, dim=-1)

    # -------------------------------------------------------------- commands
    def post(self, command: Any) -> None:
        """Rank 0: publish the next command. The one before is deleted: every rank has read it, since
        each command but the last (stop) runs collectives that all ranks joined."""
        self.store.set(f"cmd{self._sent}", pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
        if self._sent:
            self.store.delete_key(f"cmd{self._sent - 1}")
        self._sent += 1

    def next_command(self) -> Any | None:
        """A worker: the next command, or None when none came within ``POLL_TIMEOUT`` (call again)."""
        key = f"cmd{self._read}"
        try:
            self.store.wait([key], POLL_TIMEOUT)
        except dist.DistStoreError:
            if not self.store.check([key]):  # raises when rank 0's store is gone
                return None
        command = pickle.loads(self.store.get(key))
        self._read += 1
        return command

    def report_error(self, message: str) -> None:
        """A worker: leave its failure for rank 0 to raise."""
        self.store.set(f"error{self.rank}", message)

    def errors(self) -> dict[int, str]:
        """Rank 0: the failures the workers left (rank -> message)."""
        out = {}
        for rank in range(1, self.world):
            try:
                if self.store.check([f"error{rank}"]):
                    out[rank] = self.store.get(f"error{rank}").decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store itself failing is reported by the caller
                break
        return out
