"""A tensor-parallel worker (ranks 1..N-1): builds its shard and its pool, then replays rank 0's steps.

Rank 0 posts one command per collective step: ``("forward", pool_ops, input_ids, positions, batch)``
(the batch without its cache views), ``("logits", method, hidden)`` and ``("stop",)``. The pool ops are
the byte moves rank 0's cache manager made since the last forward (``CachePool.op_log``): every rank's
pool has the same layout, so replaying them keeps each rank's slice of every cache where rank 0's
allocator thinks it is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback

import torch

from hybridserve.config import EngineConfig
from hybridserve.distributed.group import Endpoint, TPGroup
from hybridserve.distributed.sharding import gather_logits

logger = logging.getLogger(__name__)


def pool_signature(pool) -> str:
    """What every rank's pool must share for rank 0's byte moves to mean the same on it."""
    layout = pool.layout
    return repr((pool.num_bytes, pool.num_pages, pool.num_slots, layout.page_bytes, layout.slot_bytes,
                 [(p.layer, p.name, p.offset, tuple(p.shape), str(p.dtype))
                  for p in (*layout.kv_placements, *layout.state_placements)]))


class WorkerRuntime:
    """One rank's model shard, pool and fast paths, built as rank 0 builds its own."""

    def __init__(self, config: EngineConfig, group: TPGroup) -> None:
        from hybridserve.engine.worker import Worker
        from hybridserve.models.loader import load_hf_config

        self.group = group
        hf_config = load_hf_config(config.model)
        torch.manual_seed(config.seed)
        worker = Worker(config, hf_config, config.resolve_dtypes(hf_config), config.resolve_device(), tp_group=group,
                        load_drafter=False)  # rank 0 alone runs a drafter, but every pool has room for its layers
        self.model, self.pool = worker.model, worker.pool
        group.store.set(f"layout{group.rank}", pool_signature(self.pool))  # rank 0 checks it against its own
        if worker.cpu_fast_paths is not None:  # RoPE tables as rank 0 makes them; no capture (the steps all-reduce)
            worker.make_runner()
            worker.capture_decode()

    @torch.inference_mode()
    def run(self, command: tuple) -> bool:
        """Run one command; False on ``stop``."""
        kind = command[0]
        if kind == "stop":
            return False
        if kind == "forward":
            _, ops, input_ids, positions, batch = command
            self.pool.apply_ops(ops)
            self.model(input_ids, positions, dataclasses.replace(batch, caches=self.pool.layer_caches))
        elif kind == "logits":
            _, method, hidden = command
            gather_logits(self.model, method, hidden)
        else:
            raise ValueError(f"unknown tensor-parallel command {kind!r}")
        return True

    def loop(self) -> None:
        """Run rank 0's commands until it says stop (or its store goes away: the store raises then)."""
        while True:
            command = self.group.next_command()
            if command is None:
                continue
            if not self.run(command):
                return


def serve_rank(config: EngineConfig, group: TPGroup) -> None:
    """Build this rank's runtime and serve rank 0 until it stops; a failure is left for rank 0 to raise."""
    try:
        group.store.set(f"hello{group.rank}", "1")
        group.connect()
        WorkerRuntime(config, group).loop()
    except BaseException:
        message = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", group.rank, message)
        try:
            group.report_error(message)
        except Exception:  # noqa: BLE001 - rank 0's store is gone too: nobody to tell
            pass
        raise


def spawned_worker_main(rank: int, world: int, endpoint: Endpoint, config: EngineConfig, threads: int) -> None:
    """Entry point of a worker process started by rank 0 on this host."""
    if threads > 0:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        serve_rank(config, TPGroup(rank, world, endpoint))
    except BaseException:  # noqa: BLE001 - reported through the store; exit non-zero
        os._exit(1)
    os._exit(0)
