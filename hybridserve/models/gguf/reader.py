"""Open a GGUF checkpoint: find the file, read its metadata, and give each tensor as a torch tensor (float types)
or a :class:`~hybridserve.models.gguf.coded.CodedWeight` (the block types the engine runs quantized)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from hybridserve.models.gguf.blocks import DECODERS, FORMATS
from hybridserve.models.gguf.coded import CodedWeight

#: GGUF tensor types read as floats (then cast to the model dtype)
FLOAT_TYPES = ("F32", "F16", "BF16")
#: GGUF block types read as floats (dequantized by the gguf package at load: no engine format holds them exactly);
#: llama-quantize writes Q5_1 and Q4_1 for the tensors whose rows are not whole k-quant super-blocks
DEQUANTIZED_TYPES = ("Q4_1", "Q5_1", "Q5_K")
#: every GGUF tensor type the loader takes
SUPPORTED_TYPES = FLOAT_TYPES + tuple(sorted(FORMATS)) + DEQUANTIZED_TYPES


def gguf_file(model: str) -> str | None:
    """The GGUF file ``model`` names: the file itself (``*.gguf``) or a folder's one ``*.gguf`` when the folder
    has no config.json; None for anything else. A folder with several GGUF files is a ValueError naming them."""
    if os.path.isfile(model):
        return model if model.endswith(".gguf") else None
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    files = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
    if len(files) > 1:
        raise ValueError(f"model={model!r} holds several GGUF files ({', '.join(files)}): pass one of them as --model")
    return os.path.join(model, files[0]) if files else None


def open_gguf(file: str) -> Any:
    """``gguf.GGUFReader`` over ``file``; a file it cannot read (truncated, not GGUF) is a one-line ValueError
    naming the file."""
    import gguf

    try:
        reader = gguf.GGUFReader(file)
        for tensor in reader.tensors:  # a truncated file ends before its last tensor's bytes
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > reader.data.size:
                raise ValueError(f"tensor {tensor.name} ends at byte {end}, past the end of the file "
                                 f"({reader.data.size} bytes): the file is truncated")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct or numpy errors on bad bytes
        message = " ".join(str(exc).split())
        raise ValueError(f"{file}: not a readable GGUF file ({type(exc).__name__}: {message})") from None
    return reader


def metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key -> its value (str, int, float, bool or a list of them)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def tensor_types(reader: Any) -> dict[str, str]:
    """Tensor name -> its GGUF type name."""
    return {t.name: t.tensor_type.name for t in reader.tensors}


def tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """Tensor name -> its shape in numpy/torch order (the reverse of GGUF's)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def check_types(reader: Any, file: str) -> None:
    """A ValueError naming the file, the first tensor of an unsupported type, that type and the supported ones."""
    for name, kind in tensor_types(reader).items():
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"{file}: tensor {name} has GGUF type {kind}, which hybridserve does not load "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")


def read_tensor(tensor: Any) -> torch.Tensor | CodedWeight:
    """One ``gguf.ReaderTensor`` in numpy/torch order (the reverse of GGUF's dimension order): a float tensor for
    F32, F16, BF16 and :data:`DEQUANTIZED_TYPES`, a CodedWeight (N, K) for a block type of ``blocks.FORMATS`` (a
    tensor of more dimensions as rows of its last one)."""
    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    if kind == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
    if kind == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16).reshape(shape))
    if kind == "BF16":
        return torch.from_numpy(np.array(data).view(np.int16).reshape(shape)).view(torch.bfloat16)
    if kind in DEQUANTIZED_TYPES:
        import gguf

        return torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).reshape(shape).astype(np.float32))
    return coded_weight(kind, decode_rows(DECODERS[kind], data))


def coded_weight(kind: str, decoded: tuple[Any, ...]) -> CodedWeight:
    """The CodedWeight of block type ``kind`` from its decoder's parts (``blocks.DECODERS``)."""
    fmt = FORMATS[kind]
    if fmt.bits == 6:  # Q6_K: codes, sub-scales, super-scales
        return CodedWeight(decoded[0], decoded[1], None, fmt.group, fmt.bits, kind, decoded[2])
    mins = decoded[2] if len(decoded) >= 3 else None
    if len(decoded) == 5:  # Q4_K: codes, scales, mins and the super-blocks' scales of both
        return CodedWeight(decoded[0], decoded[1], mins, fmt.group, fmt.bits, kind, decoded[3], decoded[4])
    return CodedWeight(decoded[0], decoded[1], mins, fmt.group, fmt.bits, kind)


#: bytes of a block tensor decoded at a time (the decoders' numpy temporaries are several times this)
DECODE_BYTES = 1 << 23


def decode_rows(decoder: Any, raw: np.ndarray) -> tuple[Any, ...]:
    """``decoder(raw)`` (a ``blocks.DECODERS`` function: rows are independent) a slice of rows at a time into
    outputs allocated once, so that its temporaries stay a few times :data:`DECODE_BYTES`."""
    rows = raw.reshape(-1, raw.shape[-1])  # (E, N, bytes) of stacked experts: E * N rows
    step = max(1, DECODE_BYTES // max(1, rows.shape[1]))
    if rows.shape[0] <= step:
        return decoder(raw)
    first = decoder(rows[:step])
    outputs = tuple(None if part is None else torch.empty((rows.shape[0], part.shape[1]), dtype=part.dtype)
                    for part in first)
    for r0 in range(0, rows.shape[0], step):
        parts = first if r0 == 0 else decoder(rows[r0:r0 + step])
        for out, part in zip(outputs, parts):
            if out is not None:
                out[r0:r0 + step] = part
    return outputs


def read_released(reader: Any, tensor: Any) -> torch.Tensor | CodedWeight:
    """:func:`read_tensor`, then the file pages it touched dropped from this process's resident memory
    (``MADV_DONTNEED`` on the read-only map: the kernel's page cache keeps them, a later read maps them
    again), so reading a whole file does not leave it counted in the process's RSS. The value read is a copy."""
    value = read_tensor(tensor)
    _release_pages(reader, int(tensor.data_offset), int(tensor.n_bytes))
    return value


def _release_pages(reader: Any, offset: int, size: int) -> None:
    """Drop the resident pages of bytes ``[offset, offset + size)`` of the reader's file map (a no-op where the
    platform has no ``madvise``)."""
    import mmap

    file_map = getattr(reader.data, "_mmap", None)
    if file_map is None or not hasattr(mmap, "MADV_DONTNEED") or size <= 0:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(offset + size, len(file_map))
    file_map.madvise(mmap.MADV_DONTNEED, start, end - start)
