"""The sharding toolkit: per-rank parameter shapes, checkpoint slicers and the output all-reduce
(``shard_*.py`` shard each kind of layer with it; ``sharding.shard_model`` walks a model)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import nn

from hybridserve.cache.spec import LayerCacheSpec
from hybridserve.distributed.group import RankGeometry, TPGroup
from hybridserve.distributed.layers import SpanningRMSNorm

Slicer = Callable[[torch.Tensor], torch.Tensor]
Segment = tuple[int, int]  # (start, size) along one dimension of the full tensor


def even(what: str, count: int, world: int) -> int:
    """``count / world``, or a ValueError naming the count (``what``) and the world size."""
    if count % world:
        raise ValueError(f"{what}={count} is not divisible by tensor_parallel_size={world}")
    return count // world


def slicer(dim: int, spans: list[Segment], pad_to: int | None = None) -> Slicer:
    """The concatenation of ``spans`` of ``dim``, zero-padded along it to ``pad_to``."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        parts = [t.narrow(dim, start, size) for start, size in spans if size > 0]
        out = torch.cat(parts, dim=dim) if len(parts) != 1 else parts[0]
        if pad_to is not None and out.shape[dim] < pad_to:
            shape = list(out.shape)
            shape[dim] = pad_to - out.shape[dim]
            out = torch.cat([out, out.new_zeros(shape)], dim=dim)
        return out.contiguous()
    return cut


def rank0_only(rank: int) -> Slicer:
    """A row-parallel bias: whole on rank 0, zeros elsewhere (the ranks' outputs are summed)."""
    return (lambda t: t) if rank == 0 else torch.zeros_like


class Sharder:
    """Shards one model's modules for ``group``'s rank, collecting the slicers by parameter name."""

    def __init__(self, group: TPGroup | RankGeometry) -> None:
        self.group = group
        self.rank, self.world = group.rank, group.world
        self.slicers: dict[str, Slicer] = {}

    # ---------------------------------------------------------------- helpers
    def param(self, prefix: str, module: nn.Module, name: str, shape: tuple[int, ...], slicer: Slicer) -> None:
        """Give ``module.name`` the per-rank ``shape`` (on meta) and record how to cut it from the checkpoint."""
        old = getattr(module, name)
        module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device),
                                                requires_grad=False)
        self.slicers[f"{prefix}{name}"] = slicer

    def column(self, prefix: str, linear: nn.Linear, segments: list[Segment]) -> None:
        """Keep output rows ``segments`` of ``linear`` (and of its bias)."""
        rows = sum(size for _, size in segments)
        self.param(prefix, linear, "weight", (rows, linear.in_features), slicer(0, segments))
        if linear.bias is not None:
            self.param(prefix, linear, "bias", (rows,), slicer(0, segments))
        linear.out_features = rows

    def row(self, prefix: str, linear: nn.Linear, segment: Segment) -> None:
        """Keep input columns ``segment`` of ``linear``; its bias on rank 0 only."""
        self.param(prefix, linear, "weight", (linear.out_features, segment[1]), slicer(1, [segment]))
        if linear.bias is not None:
            self.param(prefix, linear, "bias", tuple(linear.bias.shape), rank0_only(self.rank))
        linear.in_features = segment[1]

    def reduce_output(self, module: nn.Module) -> None:
        """Sum ``module``'s output over the ranks (its row-parallel projection gave partial sums)."""
        group = self.group
        module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))

    def state_slices(self, spec: LayerCacheSpec, shapes: dict[str, tuple[int, ...]]) -> LayerCacheSpec:
        """``spec`` with this rank's state shapes (each a slice of the first axis, rank r holding the r-th), and
        each tensor's ``shard_offset`` (where the slice starts in the whole tensor, flat)."""
        return dataclasses.replace(spec, state=tuple(
            dataclasses.replace(s, shape=tuple(shapes[s.name]), shard_offset=self.rank * math.prod(shapes[s.name]))
            for s in spec.state))

    def share(self, n: int) -> Segment:
        """This rank's (start, size) of ``n`` evenly split items."""
        size = n // self.world
        return self.rank * size, size

    def spanning_norm(self, prefix: str, norm: nn.Module, segments: list[Segment]) -> None:
        """An RMS norm over a width the ranks split: keep ``segments`` of its weight, sum the squares over ranks."""
        full = norm.weight.shape[0]
        self.param(f"{prefix}", norm, "weight", (sum(n for _, n in segments),), slicer(0, segments))
        norm.__class__ = spanning_class(type(norm))
        norm.group, norm.full_width = self.group, full

    def adapters(self, prefix: str, adapters: nn.ModuleList, rows: list[Segment]) -> None:
        """Low-rank adapters (``Sequential(down, up)`` per use) added to a column-parallel output: ``up``
        keeps the same rows, ``down`` stays whole."""
        for i, adapter in enumerate(adapters):
            if isinstance(adapter, nn.Sequential):
                self.column(f"{prefix}{i}.1.", adapter[1], rows)


_SPANNING: dict[type, type] = {}


def spanning_class(norm_class: type) -> type:
    """``norm_class`` (an RMSNorm or a subclass: its rounding) made a :class:`SpanningRMSNorm`; one class each."""
    if norm_class not in _SPANNING:
        _SPANNING[norm_class] = type(f"Spanning{norm_class.__name__}", (SpanningRMSNorm, norm_class), {})
    return _SPANNING[norm_class]
