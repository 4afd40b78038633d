"""Rank 0's side of a step: post the command, run the same computation on its own shard.

:class:`DriverModel` stands in for the model in rank 0's :class:`~hybridserve.engine.model_runner.ModelRunner`:
a forward posts the step's inputs (with the pool's byte moves since the last one) and then runs rank 0's
shard; a logits call posts the hidden rows and gathers the vocabulary slices. Any failure while the ranks
work together (a worker that died or raised, a collective that timed out, an error in rank 0's own shard)
leaves them out of step, so it raises :class:`TensorParallelError`, stops the workers, and every later call
raises too: the engine is down, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from hybridserve.cache.pool import CachePool
from hybridserve.distributed.group import TensorParallelError
from hybridserve.distributed.launch import Launch, await_keys, failure_message
from hybridserve.distributed.sharding import gather_logits
from hybridserve.forward_batch import ForwardBatch


class DriverModel:
    """Rank 0's model shard, driving the other ranks through ``launch``'s group."""

    def __init__(self, model: nn.Module, pool: CachePool, launch: Launch) -> None:
        self.model, self.pool, self.launch = model, pool, launch
        self.group = launch.group
        self.failure: str | None = None
        pool.op_log = []
        self._check_pools()

    def _check_pools(self, timeout: float = 600.0) -> None:
        """Wait for every worker's pool and check that it has rank 0's layout (the byte moves replay on it)."""
        from hybridserve.distributed.worker import pool_signature

        try:
            theirs = await_keys(self.group, "layout", self.launch, timeout, "build their shard")
        except TensorParallelError as exc:
            self._fail(str(exc))
            raise
        ours = pool_signature(self.pool)
        bad = sorted(r for r, sig in theirs.items() if sig != ours)
        if bad:
            self._fail(f"the pools of tensor-parallel ranks {bad} are laid out unlike rank 0's")
            raise TensorParallelError(self.failure)

    def __getattr__(self, name: str) -> Any:  # everything else is the shard's (hf_config, modules, ...)
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden (T, hidden), every rank running the step."""
        def forward() -> torch.Tensor:
            ops, self.pool.op_log = self.pool.op_log, []
            self.group.post(("forward", ops, input_ids, positions, dataclasses.replace(batch, caches={})))
            return self.model(input_ids, positions, batch)
        return self._together(forward)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> float32 logits (N, vocab)."""
        return self._logits("compute_logits", hidden)

    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits("sampling_logits", hidden)

    def _logits(self, method: str, hidden: torch.Tensor) -> torch.Tensor:
        def run() -> torch.Tensor:
            self.group.post(("logits", method, hidden.clone()))  # a copy: a view would send its whole storage
            return gather_logits(self.model, method, hidden)
        return self._together(run)

    def _together(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._check()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure here takes the engine down
            dead = self.launch.dead()
            self._fail(failure_message(self.group, dead, "during a step") if dead or self.group.errors()
                       else f"a tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}")
            raise TensorParallelError(self.failure) from exc

    def _check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is down: {self.failure}")
        dead = self.launch.dead()
        if dead:
            self._fail(failure_message(self.group, dead, "between steps"))
            raise TensorParallelError(self.failure)

    def _fail(self, message: str) -> None:
        self.failure = message
        self.launch.stop(grace=0.0)

    def shutdown(self) -> None:
        """Tell the workers to stop and wait for them (idempotent)."""
        if self.failure is None:
            self.failure = "the engine was shut down"
            try:
                self.group.post(("stop",))
            except Exception:  # noqa: BLE001 - workers already gone
                pass
        self.launch.stop()
