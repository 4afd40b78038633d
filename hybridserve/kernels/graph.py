"""Captured kernel graphs: a forward recorded once as the list of kernel calls it makes, replayed in
one C++ call (``csrc/graph.cpp``), the CPU counterpart of a CUDA graph.

:func:`capture` runs a function (a model's real forward over static input buffers) with every
kernel call recorded (``kernels/_abi.py``: each ``Kernel`` reports to the recorder) and every
PyTorch operator watched (a ``TorchDispatchMode``). Allocations and views are allowed; any other
operator means part of the forward runs outside the kernels, and the capture is refused with the
operators named. The temporaries the forward allocated are then given places in one arena by their
lifetimes (first to last call that touches them, so buffers of different layers share memory), and
every recorded address into them is moved there. Replaying issues the same calls with the same
arguments in the same order: its results are the forward's, bit for bit, by construction.

The caller keeps the inputs' static buffers, the model's parameters and the caches alive and in
place; an argument that points anywhere else (memory the forward freed, say) refuses the capture.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridserve.kernels import _abi

ALIGNMENT = 64  # bytes: every temporary starts on a cache line in the arena, as torch's allocator places it

# Operators a captured forward may run: they allocate or make views, and compute nothing.
ALLOCATING_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
VIEW_OPS = frozenset({"view", "_unsafe_view", "slice", "select", "split", "split_with_sizes", "unbind", "t",
                      "transpose", "permute", "unsqueeze", "squeeze", "expand", "as_strided", "alias", "detach",
                      "narrow", "chunk", "view_as", "unflatten", "flatten", "_reshape_alias"})
# Operators that return a view when they can and a copy otherwise: allowed when they returned a view.
MAYBE_VIEW_OPS = frozenset({"reshape", "contiguous", "to", "type_as", "expand_as", "reshape_as"})


class CaptureError(Exception):
    """The function cannot be captured; the message says why (the engine runs it eagerly)."""


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[_abi.Kernel, tuple]] = []

    def record(self, kernel: _abi.Kernel, args: tuple) -> None:
        self.calls.append((kernel, args))


class _OperatorGuard(TorchDispatchMode):
    """Lets allocations and views run (keeping every allocation), and notes any other operator."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.others: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ALLOCATING_OPS:
            self.allocations.append(out)
        elif name in MAYBE_VIEW_OPS and _shares_storage(out, args[0] if args else None):
            pass
        elif name not in VIEW_OPS:
            key = str(func.overloadpacket)
            self.others[key] = self.others.get(key, 0) + 1
        return out


def _shares_storage(out, source) -> bool:
    return (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)
            and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr())


def _float_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def tensor_region(t: torch.Tensor) -> tuple[int, int]:
    """(start address, bytes) of the storage under ``t``."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def module_regions(module: torch.nn.Module) -> list[tuple[int, int]]:
    """The memory of every tensor a module tree holds: parameters, buffers and tensors kept as plain
    attributes (derived parameters a layer caches for its kernels, say)."""
    regions = []

    def visit(value, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.numel():
                regions.append(tensor_region(value))
        elif isinstance(value, (tuple, list)) and depth < 3:
            for v in value:
                visit(v, depth + 1)
        elif isinstance(value, dict) and depth < 3:
            for v in value.values():
                visit(v, depth + 1)

    for m in module.modules():
        for value in list(m._parameters.values()) + list(m._buffers.values()) + list(vars(m).values()):
            visit(value)
    return regions


@dataclass
class _Temp:
    start: int
    nbytes: int
    first: int  # first call touching it
    last: int  # last call touching it (the number of calls for the output: alive after the replay)
    offset: int = -1  # place in the arena


def _plan(temps: list[_Temp]) -> int:
    """Gives each temporary an arena offset, none overlapping another alive at the same time (largest
    first, lowest fitting offset); returns the arena size."""
    placed: list[_Temp] = []
    size = 0
    for temp in sorted(temps, key=lambda t: (-t.nbytes, t.first)):
        busy = sorted((p.offset, p.offset + p.nbytes) for p in placed if p.first <= temp.last and temp.first <= p.last)
        offset = 0
        for lo, hi in busy:
            if offset + temp.nbytes <= lo:
                break
            offset = max(offset, -(-hi // ALIGNMENT) * ALIGNMENT)
        temp.offset = offset
        placed.append(temp)
        size = max(size, offset + temp.nbytes)
    return -(-size // ALIGNMENT) * ALIGNMENT


class Graph:
    """A captured forward: :meth:`replay` reruns it; its result is then in :attr:`output`."""

    def __init__(self, calls: list[tuple[_abi.Kernel, tuple]], output: torch.Tensor,
                 static_regions: Iterable[tuple[int, int]], allocations: list[torch.Tensor]) -> None:
        self.kernel_names = [kernel.name for kernel, _ in calls]
        self.num_calls = len(calls)
        # the temporaries, by start address; a view's address falls inside its allocation's range
        temps: dict[int, _Temp] = {}
        for t in allocations:
            start, nbytes = tensor_region(t)
            if nbytes:
                temps[start] = _Temp(start, nbytes, first=len(calls), last=-1)
        starts = sorted(temps)
        statics = sorted(static_regions)
        static_starts = [s for s, _ in statics]

        def temp_of(address: int) -> _Temp | None:
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0 and address <= starts[i] + temps[starts[i]].nbytes:
                return temps[starts[i]]
            return None

        def is_static(address: int) -> bool:
            i = bisect.bisect_right(static_starts, address) - 1
            return i >= 0 and address <= statics[i][0] + statics[i][1]

        ops: list[int] = []
        args: list[int] = []
        self._relocations: list[tuple[int, _Temp, int]] = []  # (index in args, temporary, offset into it)
        for index, (kernel, values) in enumerate(calls):
            ops += [kernel.invoker, kernel.address, len(args)]
            for position, (value, kind) in enumerate(zip(values, kernel.signature)):
                if kind == "f":
                    args.append(_float_bits(value))
                    continue
                if kind in "pw" and value:
                    temp = temp_of(value)
                    if temp is not None:
                        temp.first, temp.last = min(temp.first, index), max(temp.last, index)
                        self._relocations.append((len(args), temp, value - temp.start))
                    elif not is_static(value):
                        raise CaptureError(f"argument {position} of {kernel.name} (call {index}) points outside the "
                                           "model, the caches, the static inputs and the forward's own buffers")
                args.append(0 if value is None else int(value))
        out_start, _ = tensor_region(output)
        out_temp = temps.get(out_start)
        if out_temp is None:
            raise CaptureError("the forward's result is not a buffer it allocated")
        out_temp.first, out_temp.last = min(out_temp.first, len(calls)), len(calls)
        self._temps = [t for t in temps.values() if t.last >= 0]
        self.arena_bytes = _plan(self._temps)
        self._output_spec = (out_temp, output.dtype, tuple(output.shape), output.stride(), output.storage_offset())
        self._ops = (ctypes.c_int64 * len(ops))(*ops)
        self._args = (ctypes.c_int64 * len(args))(*args)
        self.output: torch.Tensor | None = None
        self._arena: torch.Tensor | None = None
        self._failed = ctypes.c_int64(-1)
        self._timing: torch.Tensor | None = None

    def place(self, arena: torch.Tensor) -> None:
        """Put the temporaries in ``arena`` (uint8, at least :attr:`arena_bytes`, 64-byte aligned; graphs
        never replayed at the same time may share one)."""
        if arena.dtype != torch.uint8 or arena.numel() < self.arena_bytes or arena.data_ptr() % ALIGNMENT:
            raise ValueError(f"an aligned uint8 arena of {self.arena_bytes} bytes is needed")
        base = arena.data_ptr()
        for position, temp, offset in self._relocations:
            self._args[position] = base + temp.offset + offset
        temp, dtype, shape, stride, storage_offset = self._output_spec
        itemsize = torch.empty(0, dtype=dtype).element_size()
        # as_strided counts from the start of the arena's storage
        self.output = arena.view(dtype).as_strided(shape, stride, temp.offset // itemsize + storage_offset)
        self._arena = arena

    def start_profiling(self) -> None:
        """From now on, add up each call's time over replays (read with :meth:`kernel_seconds`)."""
        self._timing = torch.zeros(self.num_calls, dtype=torch.int64)

    def kernel_seconds(self) -> dict[str, float]:
        """Seconds spent per kernel (C function name) since :meth:`start_profiling`."""
        totals: dict[str, float] = {}
        if self._timing is not None:
            for name, ns in zip(self.kernel_names, self._timing.tolist()):
                totals[name] = totals.get(name, 0.0) + ns * 1e-9
        return totals

    def replay(self) -> torch.Tensor:
        """Run the captured calls; returns :attr:`output` (overwritten by the next replay)."""
        if self._arena is None:
            raise RuntimeError("Graph.place(arena) must come before replay")
        timing = 0 if self._timing is None else self._timing.data_ptr()
        rc = _runner().hs_graph_run(ctypes.addressof(self._ops), self.num_calls, ctypes.addressof(self._args),
                                    ctypes.addressof(self._failed), timing)
        if rc != 0:
            i = self._failed.value
            raise RuntimeError(f"captured call {i} of {self.num_calls} ({self.kernel_names[i]}) failed (code {rc})")
        assert self.output is not None  # (set by place, with the arena)
        return self.output


def _runner():
    lib = _abi.bind("graph")
    if lib is None:
        from hybridserve.kernels.build import unavailable_reason

        raise CaptureError(f"the graph runner is not available ({unavailable_reason('graph') or 'not built'})")
    return lib


def capture(forward: Callable[[], torch.Tensor], static_regions: Iterable[tuple[int, int]]) -> Graph:
    """Run ``forward()`` once, recording its kernel calls, and return them as a :class:`Graph` (not yet
    placed in an arena). ``static_regions``: (address, bytes) of the memory that stays put between
    replays (parameters, caches, input buffers). Raises :class:`CaptureError` when the forward runs
    operators other than kernels, allocations and views, or makes no kernel call."""
    _runner()
    if _abi.recorder is not None:
        raise CaptureError("a capture is already in progress")
    recorder, guard = _Recorder(), _OperatorGuard()
    _abi.recorder = recorder
    try:
        with guard:
            output = forward()
    finally:
        _abi.recorder = None
    if guard.others:
        names = ", ".join(f"{name} x{n}" for name, n in sorted(guard.others.items(), key=lambda kv: -kv[1]))
        raise CaptureError(f"the forward runs PyTorch operators outside the kernels: {names}")
    if not recorder.calls:
        raise CaptureError("the forward makes no kernel call")
    return Graph(recorder.calls, output, static_regions, guard.allocations)
