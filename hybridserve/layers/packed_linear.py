"""Linear layers with prepacked bf16 weights for the CPU.

Two packings, both chosen after loading, each releasing the original weight so memory does not
grow (a tied LM head keeps the embedding's weight):

* :class:`KernelLinear`, with the CPU kernels on (``EngineConfig.cpu_kernels``) and an AVX-512 BF16
  CPU: hybridserve's own kernel (``kernels/csrc/gemm.cpp``). Against oneDNN on the benchmark model's
  layers (``benchmarks/matmul_rate.py``): one token streams the weights at 28-31 GB/s instead of
  19-22, 8 rows run 1.4x faster, 32 rows about 1.1x, 2048-token prefills within 5%. Its float32 sums
  are rounded once to bf16, as oneDNN's are, but in another order, so the last bit of an output can
  differ.
* :class:`PackedLinear` for the remaining bf16 layers (``EngineConfig.cpu_weight_prepack``):
  oneDNN's prepacked matmul, bit-identical to ``torch.nn.functional.linear`` on bf16 and 15-35%
  faster than it for decode-sized batches.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hybridserve.kernels import gemm, hugepages


def prepack_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class _PackedWeightLinear(nn.Module):
    """``y = x @ W.T + b`` with W held only in a packed form (``packed_weight``); subclasses run it."""

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", packed_weight, persistent=False)
        self.bias = linear.bias


class PackedLinear(_PackedWeightLinear):
    """``y = x @ W.T + b`` with W prepacked for oneDNN (CPU, bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class KernelLinear(_PackedWeightLinear):
    """``y = x @ W.T + b`` with W packed for hybridserve's bf16 CPU kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) bf16 -> (..., out_features) bf16."""
        y = gemm.linear(x, self.packed_weight, self.out_features, self.bias)
        if y is None:
            raise TypeError(f"KernelLinear takes bf16 CPU input with {self.in_features} features, "
                            f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        return y

    def emit(self, program, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``out = x @ W.T + b`` to a decode program (``kernels.program.ProgramBuilder``); x, out: (rows, width)
        bf16, column slices of wider buffers allowed."""
        from hybridserve.kernels.program import Step, Unsupported

        bias_ok = self.bias is None or (self.bias.dtype == torch.bfloat16 and self.bias.is_contiguous()
                                         and self.bias.shape == (self.out_features,))
        if (x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or x.shape[1] != self.in_features
                or out.shape[1] != self.out_features or not bias_ok):
            raise Unsupported(f"KernelLinear {self.in_features}->{self.out_features} cannot take "
                              f"{x.dtype} {tuple(x.shape)} -> {out.dtype} {tuple(out.shape)}")
        x_ptr, xs = program.rows(x)
        out_ptr, os_ = program.rows(out)
        program.call("hs_linear_bf16", [Step.ROWS, self.out_features, self.in_features, x_ptr, xs,
                                        program.ptr(self.packed_weight), program.ptr(self.bias), out_ptr, os_])


def emit_linear(program, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    """Add linear ``layer`` to a decode program: only :class:`KernelLinear` layers can be."""
    from hybridserve.kernels.program import Unsupported

    if not isinstance(layer, KernelLinear):
        raise Unsupported(f"{type(layer).__name__} layers have no decode-program kernel (bf16 KernelLinear only)")
    layer.emit(program, x, out)


def _packable_linears(model: nn.Module):
    """(parent, name, linear) for every bf16 CPU ``nn.Linear`` that may be packed."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or not getattr(child, "prepack", True):
                continue  # a layer that reads its .weight directly sets prepack = False
            if child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu":
                yield parent, name, child


def _replace_linears(model: nn.Module, pack: Callable[[torch.Tensor], torch.Tensor | None],
                     make: Callable[[nn.Linear, torch.Tensor], nn.Module]) -> int:
    """Replace every bf16 CPU ``nn.Linear`` whose weight ``pack`` accepts by ``make(linear, packed)``.

    Layers that share one weight (tied or reused blocks) share one packed copy. Returns how many."""
    packed: dict[int, torch.Tensor | None] = {}
    count = 0
    for parent, name, child in _packable_linears(model):
        weight = child.weight
        if id(weight) not in packed:
            packed[id(weight)] = pack(weight.detach())
        if packed[id(weight)] is not None:
            setattr(parent, name, make(child, packed[id(weight)]))
            count += 1
    return count


def pack_kernel_linear_layers(model: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` the CPU kernel covers by a :class:`KernelLinear`; returns how many.

    The packed weights share one allocation on huge pages (``kernels.hugepages``), each starting on a
    cache line."""
    if not gemm.available():
        return 0
    def key(w: torch.Tensor) -> tuple:
        return w.data_ptr(), tuple(w.shape), w.stride()

    sizes: dict[tuple, int] = {}  # weight -> packed elements, rounded up to 64 bytes
    for _, _, child in _packable_linears(model):
        if gemm.packable(child.weight):
            sizes.setdefault(key(child.weight), -(-gemm.packed_numel(*child.weight.shape) // 32) * 32)
    arena = hugepages.empty(sum(sizes.values()), torch.bfloat16)
    slots: dict[tuple, torch.Tensor] = {}
    offset = 0
    for k, n in sizes.items():
        slots[k] = arena[offset:offset + n]
        offset += n

    def pack_into_arena(weight: torch.Tensor) -> torch.Tensor | None:
        slot = slots.get(key(weight))
        if slot is None:
            return None
        return gemm.pack(weight, slot[:gemm.packed_numel(*weight.shape)])

    return _replace_linears(model, pack_into_arena, KernelLinear)


def pack_linear_layers(model: nn.Module, batch_hint: int = 32) -> int:
    """Replace every (remaining) bf16 CPU ``nn.Linear`` by a :class:`PackedLinear`; returns how many."""
    if not prepack_available():
        return 0
    return _replace_linears(model, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), PackedLinear)


def copy_remaining_parameters(model: nn.Module) -> None:
    """Give every CPU parameter its own memory.

    Loaded weights are views of the checkpoint file's memory map, which stays mapped (its pages
    resident) while any of them lives. After packing, the packed layers' original weights are gone,
    but the embedding, norms and the like would keep the whole map alive; copying those (a few
    percent of the model) releases it."""
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu":
                param.data = param.data.clone()
