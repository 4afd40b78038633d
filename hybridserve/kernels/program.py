"""Decode steps as one C++ call (``csrc/program.cpp``): a fixed list of kernel calls built once.

A model that can (``build_decode_program``) lists, at engine start, every kernel call of a decode
step: the same kernels with the same arguments as its modules' CPU-kernel paths, into workspace
buffers of ``max_rows`` rows. Each decode step then fills in the per-step values (the number of
sequences, token ids, state slots, block tables, ...) and runs the list in one call, bit-identical to
the module path without its Python between the kernels.

Arguments are given as Python values in the kernels' own C signatures; a :class:`Step` member stands
for a per-step value. A layer that cannot be expressed raises :class:`Unsupported`, and the engine
keeps the module path.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import struct
from typing import Sequence

import torch

from hybridserve.kernels import attention, gemm, pointwise, recurrent
from hybridserve.kernels._abi import DTYPE_CODES, F32, I64, PTR, bind, rows_ok

logger = logging.getLogger(__name__)

_SIGNATURES = {"hs_program_run": [PTR, I64, PTR, PTR, PTR, PTR], "hs_program_step_fields": [],
               "hs_program_kernels": []}


class Unsupported(Exception):
    """This model, layer or setting has no decode program; the module path is used."""


class Step(enum.IntEnum):
    """Per-step values (StepField in csrc/program.cpp)."""

    ROWS = 0
    INPUT_IDS = 1
    CU_SEQLENS = 2
    STATE_INDICES = 3
    SEQ_LENS = 4
    BLOCK_TABLES = 5
    BLOCK_TABLE_STRIDE = 6
    SLOT_MAPPING = 7
    ROPE_COS = 8
    ROPE_SIN = 9


NUM_STEP_FIELDS = len(Step)

# (module, C function) per kernel, in the order of Kernel in csrc/program.cpp.
KERNELS = [(pointwise, "hs_rms_norm"), (gemm, "hs_linear_bf16"), (recurrent, "hs_causal_conv1d"),
           (recurrent, "hs_mamba2_scan"), (pointwise, "hs_gated_rms_norm"), (pointwise, "hs_silu_mul"),
           (attention, "hs_kv_write"), (attention, "hs_paged_attention"), (pointwise, "hs_rotary"),
           (gemm, "hs_linear_f16")]
_OP_EMBED, _OP_CALL = 1, 2
_KIND_VALUE, _KIND_FLOAT, _KIND_STEP = 0, 1, 2


def _library():
    return bind("program", _SIGNATURES)


def available() -> bool:
    """Whether programs can run here: the executor and every kernel it calls are built."""
    lib = _library()
    return (lib is not None and lib.hs_program_step_fields() == NUM_STEP_FIELDS
            and lib.hs_program_kernels() == len(KERNELS)
            and all(module._library() is not None for module, _ in KERNELS))


def _float_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


class ProgramBuilder:
    """Collects the kernel calls of one decode step, over workspace rows allocated here."""

    def __init__(self, max_rows: int) -> None:
        if not available():
            from hybridserve.kernels import unavailable_reason

            raise Unsupported(f"the compiled CPU kernels are not available ({unavailable_reason() or 'not built'})")
        self.max_rows = max_rows
        self._code: list[int] = []
        self._count = 0
        self._keep: list[torch.Tensor] = []  # every tensor an argument points into
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._rotary = None  # (rotary embedding module, dtype): cos/sin computed per step from positions

    def buffer(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A (max_rows, width) workspace tensor owned by the program."""
        t = torch.empty(self.max_rows, width, dtype=dtype)
        self._keep.append(t)
        return t

    def scratch(self, name: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A (max_rows, width) workspace tensor shared by every request of the same name, width and
        dtype: for temporaries that no later op of another request still needs (one layer's, say)."""
        key = (name, width, dtype)
        if key not in self._scratch:
            self._scratch[key] = self.buffer(width, dtype)
        return self._scratch[key]

    def keep(self, *tensors: torch.Tensor | None) -> None:
        """Keep tensors the program points into (parameters it derived, say) alive with it."""
        self._keep.extend(t for t in tensors if t is not None)

    def rows(self, t: torch.Tensor) -> tuple[int, int]:
        """(address, row stride) of a (rows, width) CPU tensor with contiguous rows, kept alive with the
        program."""
        if not rows_ok(t):
            raise Unsupported(f"a (rows, width) tensor with contiguous rows is needed, got {tuple(t.shape)} "
                              f"strides {t.stride()} on {t.device}")
        self._keep.append(t)
        return t.data_ptr(), t.stride(0)

    def ptr(self, t: torch.Tensor | None) -> int | None:
        """The address of t (None for None), kept alive with the program: every tensor a call points
        into goes through here or :meth:`rows`, so a program outliving its engine stays valid."""
        if t is None:
            return None
        self._keep.append(t)
        return t.data_ptr()

    @staticmethod
    def dtype_code(dtype: torch.dtype) -> int:
        if dtype not in DTYPE_CODES:
            raise Unsupported(f"no kernel takes {dtype}")
        return DTYPE_CODES[dtype]

    def _append(self, op: int, args: list[tuple[int, int]]) -> None:
        self._code += [op, len(args)]
        for kind, value in args:
            self._code += [kind, value]
        self._count += 1

    def embed(self, table: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        """out[:rows] = table[input_ids] * scale (rounded to the table's dtype when scale != 1)."""
        if table.dim() != 2 or table.stride(1) != 1 or out.dtype != table.dtype or out.shape[1] != table.shape[1]:
            raise Unsupported("the embedding needs a row-major table and an output of its width and dtype")
        out_ptr, out_stride = self.rows(out)
        self._append(_OP_EMBED, [(_KIND_VALUE, self.dtype_code(table.dtype)), (_KIND_VALUE, self.ptr(table)),
                                 (_KIND_VALUE, table.stride(0)), (_KIND_VALUE, table.shape[0]),
                                 (_KIND_VALUE, table.shape[1]), (_KIND_VALUE, out_ptr), (_KIND_VALUE, out_stride),
                                 (_KIND_STEP, Step.ROWS), (_KIND_STEP, Step.INPUT_IDS),
                                 (_KIND_FLOAT, _float_bits(scale))])

    def call(self, function: str, args: Sequence[int | float | Step | None]) -> None:
        """A call of kernel ``function`` (a KERNELS name) with ``args`` in its C signature's order."""
        index = next((i for i, (_, name) in enumerate(KERNELS) if name == function), None)
        if index is None:
            raise ValueError(f"{function!r} is not a program kernel; those are {[n for _, n in KERNELS]}")
        signature = KERNELS[index][0]._SIGNATURES[function]
        if len(args) != len(signature):
            raise ValueError(f"{function} takes {len(signature)} arguments, got {len(args)}")
        encoded = [(_KIND_VALUE, index)]
        for arg, ctype in zip(args, signature):
            if isinstance(arg, Step):
                encoded.append((_KIND_STEP, int(arg)))
            elif ctype is F32:
                encoded.append((_KIND_FLOAT, _float_bits(arg)))
            else:
                encoded.append((_KIND_VALUE, 0 if arg is None else int(arg)))
        self._append(_OP_CALL, encoded)

    def rotary(self, x: torch.Tensor, num_heads: int, head_dim: int, rotary_emb: torch.nn.Module) -> None:
        """Rotate x (rows, num_heads * head_dim) in place by ``rotary_emb(positions, x.dtype)``, the
        per-step cos/sin (one module per program)."""
        R = rotary_emb.rotary_dim
        if not pointwise.covers_rotary(R, head_dim, x.dtype):
            raise Unsupported(f"RoPE over {R} of {head_dim} features in {x.dtype} has no CPU kernel")
        if self._rotary is not None and self._rotary != (rotary_emb, x.dtype):
            raise Unsupported("a decode program takes one rotary embedding")
        self._rotary = (rotary_emb, x.dtype)
        x_ptr, xs = self.rows(x)
        self.call("hs_rotary", [self.dtype_code(x.dtype), Step.ROWS, num_heads, head_dim, R, x_ptr, xs,
                                Step.ROPE_COS, Step.ROPE_SIN, R])

    def build(self, output: torch.Tensor) -> "Program":
        """The program; a step's result is ``output[:rows]``."""
        self.keep(output)
        return Program(self._code, self._count, self._keep, output, self.max_rows, self._rotary)


class Program:
    """A built decode program; :meth:`run` executes one step."""

    def __init__(self, code: list[int], num_ops: int, keep: list[torch.Tensor], output: torch.Tensor,
                 max_rows: int, rotary: tuple | None = None) -> None:
        self._lib = _library()
        self._code = (ctypes.c_int64 * len(code))(*code)
        self._n = len(code)
        self._kernels = (ctypes.c_int64 * len(KERNELS))(
            *[ctypes.cast(getattr(module._library(), name), ctypes.c_void_p).value for module, name in KERNELS])
        self._keep = keep
        self._failed = ctypes.c_int64(-1)
        self._timing = None  # (len(KERNELS) + 1) int64 nanoseconds per kernel, when profiling
        self.num_ops = num_ops
        self.output = output
        self.max_rows = max_rows
        self.rotary = rotary  # (module, dtype) whose (cos, sin) each step needs, or None

    def start_profiling(self) -> None:
        """From now on, add up each kernel's time over runs (read with :meth:`kernel_seconds`)."""
        self._timing = (ctypes.c_int64 * (len(KERNELS) + 1))()

    def kernel_seconds(self) -> dict[str, float]:
        """Seconds spent per kernel (C function name; ``embedding`` for the embedding) since
        :meth:`start_profiling`."""
        if self._timing is None:
            return {}
        names = [name for _, name in KERNELS] + ["embedding"]
        return {name: self._timing[i] * 1e-9 for i, name in enumerate(names)}

    def run(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor | None,
            seq_lens: torch.Tensor | None, block_tables: torch.Tensor | None,
            slot_mapping: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of ``rows = input_ids.numel()`` sequences (one token each); every index tensor
        contiguous int64 on the CPU (``positions``: each token's position, for RoPE). Returns the final
        hidden states, a (rows, hidden) view of the program's output buffer (overwritten by the next run)."""
        rows = input_ids.numel()
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a decode program step takes 1 to {self.max_rows} sequences, got {rows}")
        for name, t, n in (("input_ids", input_ids, rows), ("cu_seqlens", cu_seqlens, rows + 1),
                           ("state_indices", state_indices, rows), ("seq_lens", seq_lens, rows),
                           ("slot_mapping", slot_mapping, rows), ("positions", positions, rows)):
            if t is not None and (t.dtype != torch.int64 or not t.is_contiguous() or t.numel() != n or t.is_cuda):
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor of {n} elements")
        if block_tables is not None and (block_tables.dtype != torch.int64 or not block_tables.is_contiguous()
                                         or block_tables.dim() != 2 or block_tables.shape[0] != rows):
            raise ValueError(f"block_tables must be a contiguous int64 ({rows}, width) tensor")

        def addr(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.data_ptr()

        cos = sin = None
        if self.rotary is not None:
            if positions is None:
                raise ValueError("this decode program applies RoPE: positions are needed")
            module, dtype = self.rotary
            cos, sin = (t.contiguous() for t in module(positions, dtype))  # (rows, R) each

        step = (ctypes.c_int64 * NUM_STEP_FIELDS)(
            rows, input_ids.data_ptr(), cu_seqlens.data_ptr(), addr(state_indices), addr(seq_lens),
            addr(block_tables), 0 if block_tables is None else block_tables.stride(0), addr(slot_mapping),
            addr(cos), addr(sin))
        rc = self._lib.hs_program_run(self._code, self._n, step, self._kernels, ctypes.byref(self._failed),
                                      self._timing)
        if rc != 0:
            raise RuntimeError(f"decode program op {self._failed.value} of {self.num_ops} failed (code {rc})")
        return self.output[:rows]


def build_decode_program(model: torch.nn.Module, caches: dict, max_rows: int) -> tuple[Program | None, str | None]:
    """The decode program of ``model`` (its ``build_decode_program(builder, caches)``) for up to
    ``max_rows`` sequences a step, and None; or None and the reason when the model, a layer or a
    setting has none (the engine logs it)."""
    build = getattr(model, "build_decode_program", None)
    if build is None:
        return None, f"{type(model).__name__} has no decode program"
    try:
        builder = ProgramBuilder(max_rows)
        output = build(builder, caches)
        program = builder.build(output)
    except Unsupported as exc:
        return None, str(exc)
    logger.info("decode program: %d kernel calls a step, %d rows at most", program.num_ops, max_rows)
    return program, None
