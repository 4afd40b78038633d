"""Checks on checkpoint tensors as they are read: readable files, finite values, the right kind of dtype.

A weight with a NaN or an infinity gives a model whose every logit is NaN (greedy answers come back empty,
as if stopped); an int or bool tensor where a float weight belongs would be cast without a word. Both are
refused at load, naming the tensor and its file. The finiteness check costs one reduction per tensor:
the tensor's sum, which is finite only when every value is (NaN and infinities propagate); when it is not
(a float16 sum can also overflow), ``aminmax`` decides exactly, and only a tensor that fails is scanned for
the count of bad values. Neither allocates a tensor-sized temporary. fp8 tensors have no CPU reductions:
their bytes are masked to the exponent bits that mark a NaN or an infinity, a chunk at a time.
"""

from __future__ import annotations

from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

#: fp8 tensors are checked this many elements at a time
FP8_CHUNK = 1 << 24
#: fp8 dtype -> the bits that are all set exactly in its non-finite values (e4m3fn: NaN only, S.1111.111;
#: e5m2: infinities and NaNs, S.11111.xx); other fp8 kinds are checked through float16 (exact: every fp8 value is one)
FP8_NONFINITE_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


class CheckedFile:
    """An open safetensors file whose tensors are checked as they are read (:meth:`get_tensor`); errors
    from a truncated or corrupt file become ValueErrors naming it."""

    def __init__(self, handle, file: str) -> None:
        self.handle, self.file = handle, file

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get_tensor(self, raw: str) -> torch.Tensor:
        """Tensor ``raw`` of this file; ValueError naming it when it holds a NaN or an infinity."""
        try:
            tensor = self.handle.get_tensor(raw)
        except SafetensorError as exc:
            raise ValueError(f"weights file {self.file!r}: tensor {raw!r} is unreadable ({exc}); the file is "
                             f"corrupt") from None
        check_finite(tensor, f"weight {raw!r} in {self.file!r}")
        return tensor


def open_checked(files: list[str]) -> Iterator[CheckedFile]:
    """Each safetensors file of ``files`` opened in turn as a :class:`CheckedFile` (ValueError naming a file
    that is missing, truncated or not safetensors)."""
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"weights file {file!r} is truncated, corrupt or unreadable ({exc})") from None
        with handle:
            yield CheckedFile(handle, file)


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """ValueError naming ``what`` unless every value of the floating-point ``tensor`` is finite (others pass)."""
    if not tensor.is_floating_point() or tensor.numel() == 0 or _all_finite(tensor):
        return
    flat = tensor.reshape(-1)
    bad = ~torch.isfinite(flat if tensor.dtype not in _FP8 else flat.to(torch.float16))
    count, first = int(bad.sum()), int(bad.nonzero()[0, 0])
    raise ValueError(f"{what} has {count} NaN or infinite value(s) of {tensor.numel()} (first at flat index "
                     f"{first}, value {flat[first].item()}): the checkpoint is corrupt")


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))


def _all_finite(tensor: torch.Tensor) -> bool:
    if tensor.dtype in _FP8:
        flat = tensor.reshape(-1)
        bits = FP8_NONFINITE_BITS.get(tensor.dtype)
        for i in range(0, flat.numel(), FP8_CHUNK):
            chunk = flat[i:i + FP8_CHUNK]
            if bits is None and not _all_finite(chunk.to(torch.float16)):
                return False
            if bits is not None and int((chunk.view(torch.uint8) & bits).amax()) == bits:
                return False
        return True
    if bool(torch.isfinite(tensor.sum())):
        return True
    low, high = torch.aminmax(tensor)  # the sum may have overflowed: decide exactly
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def dtype_class(dtype: torch.dtype) -> str:
    """``floating`` (fp8 included), ``bool``, ``complex`` or ``integer``."""
    if dtype.is_floating_point:
        return "floating"
    if dtype == torch.bool:
        return "bool"
    return "complex" if dtype.is_complex else "integer"


_KIND = {"floating": "a floating-point", "integer": "an integer", "bool": "a bool", "complex": "a complex"}


def wrong_dtype_classes(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """One line per checkpoint tensor whose dtype is of another class than its model parameter's (an int or bool
    tensor for a float weight, a float one for integer codes), naming it, its dtype and the class expected."""
    bad = []
    for name, tensor in loaded.items():
        want = dtype_class(expected[name].dtype)
        if dtype_class(tensor.dtype) != want:
            bad.append(f"{name}: {str(tensor.dtype).removeprefix('torch.')}, expected {_KIND[want]} dtype")
    return bad
