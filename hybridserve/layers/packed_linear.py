"""Linear layers with prepacked 16-bit weights for the CPU.

Three packings, each chosen after loading, each releasing the original weight so memory does not
grow (a tied LM head keeps the embedding's weight):

* :class:`KernelLinear`, with the CPU kernels on (``EngineConfig.cpu_kernels``), for every bf16 and
  fp16 ``nn.Linear`` on every CPU: hybridserve's own kernels (``kernels/csrc/gemm.cpp``), the
  weights kept 16-bit in memory. On AVX-512 BF16 CPUs bf16 runs on its dot products; against oneDNN
  on the benchmark model's layers (``benchmarks/matmul_rate.py``) one token streams the weights at
  28-31 GB/s instead of 19-22, 8 rows run 1.4x faster, 32 rows about 1.1x, 2048-token prefills
  within 5%. Elsewhere (AVX2, AVX-512 without BF16, other ISAs) the weights are widened to float32 in
  registers, where torch's own bf16 matmul would fall onto a scalar path (0.3 GFLOP/s on AVX2). Its
  float32 sums are rounded once to the activation dtype, as oneDNN's are, but in another order, so
  the last bit of an output can differ.
* :class:`~hybridserve.layers.linear_w8.W8Linear` for 8-bit weights: every linear with
  ``EngineConfig.quantization="int8"`` (quantized here, per output channel) and a checkpoint's fp8 ones
  (``docs/quantization.md``).
* :class:`~hybridserve.layers.linear_w4.W4Linear` for 4-bit weights: every linear with
  ``EngineConfig.quantization="int4"`` (centred codes, a scale per group of in-features kept as a uint8 sub-scale
  of a float16 one per 256 in-features), MoE experts
  too; a linear whose in-features the 4-bit kernel does not take (not a multiple of 8) is made int8 instead.
* :class:`PackedLinear` for the remaining bf16 layers (``EngineConfig.cpu_weight_prepack``), on CPUs
  where oneDNN's bf16 matmul runs natively (AVX-512 BW/VL/DQ, with the ISA in force allowing it):
  oneDNN's prepacked matmul, bit-identical to ``torch.nn.functional.linear`` on bf16 and 15-35%
  faster than it for decode-sized batches.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hybridserve.kernels import gemm, hugepages, isa, linear_w4, linear_w8
from hybridserve.kernels.heap import release_free_heap
from hybridserve.layers.linear_w4 import W4Linear, quantize_w4_sub
from hybridserve.layers.linear_w8 import W8Linear
from hybridserve.layers.moe import FusedExperts
from hybridserve.ops.linear_w8 import quantize_int8


def prepack_available() -> bool:
    """Whether oneDNN's prepacked bf16 linear runs here: the torch build has the ops, this CPU runs
    oneDNN's bf16 path (torch's own check: AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and the ISA in force
    is at least avx512 (a cap below it keeps oneDNN off its AVX-512 code)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and isa.at_least("avx512")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


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
    """``y = x @ W.T + b`` with W packed for hybridserve's 16-bit CPU kernels (bf16 or fp16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) in the weight's dtype -> (..., out_features) in that dtype."""
        y = gemm.linear(x, self.packed_weight, self.out_features, self.bias)
        if y is None:
            raise TypeError(f"KernelLinear takes {self.packed_weight.dtype} CPU input with {self.in_features} "
                            f"features, got {x.dtype} {tuple(x.shape)} on {x.device}")
        return y


def _packable_linears(model: nn.Module):
    """(parent, name, linear) for every bf16, fp16, float32 or fp8 (a checkpoint's, with its
    ``weight_scale``) CPU ``nn.Linear`` that may be packed."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or not getattr(child, "prepack", True):
                continue  # a layer that reads its .weight directly sets prepack = False
            if child.weight.device.type == "cpu" and (child.weight.dtype in gemm.LINEAR_DTYPES or is_fp8_linear(child)):
                yield parent, name, child


def is_fp8_linear(linear: nn.Module) -> bool:
    """An ``nn.Linear`` holding a checkpoint's 8-bit codes: fp8 e4m3 (an fp8 checkpoint) or int8 (a GGUF file's
    Q8_0 or Q6_K weight), with ``weight_scale`` (N, G) float32 and ``weight_group``, set by the loader."""
    return linear.weight.dtype in (torch.float8_e4m3fn, torch.int8) and hasattr(linear, "weight_scale")


def _replace_linears(model: nn.Module, pack: Callable[[nn.Linear], torch.Tensor | None],
                     make: Callable[[nn.Linear, torch.Tensor], nn.Module]) -> int:
    """Replace every CPU ``nn.Linear`` that ``pack`` accepts by ``make(linear, packed)``.

    Layers that share one weight (tied or reused blocks) share one packed copy. Returns how many."""
    packed: dict[int, torch.Tensor | None] = {}
    count = 0
    for parent, name, child in _packable_linears(model):
        weight = child.weight
        if id(weight) not in packed:
            packed[id(weight)] = pack(child)
        if packed[id(weight)] is not None:
            setattr(parent, name, make(child, packed[id(weight)]))
            count += 1
    return count


def _key(w: torch.Tensor) -> tuple:
    return w.data_ptr(), tuple(w.shape), w.stride(), w.dtype


class _Arena:
    """One allocation on huge pages per dtype (``kernels.hugepages``) for the packed weights, each slot
    starting on a cache line."""

    def __init__(self, sizes: dict[tuple, tuple[torch.dtype, int]]) -> None:  # weight key -> (dtype, elements)
        rounded = {k: (dt, -(-n * dt.itemsize // 64) * 64 // dt.itemsize) for k, (dt, n) in sizes.items()}
        totals: dict[torch.dtype, int] = {}
        for dt, n in rounded.values():
            totals[dt] = totals.get(dt, 0) + n
        arenas = {dt: hugepages.empty(n, dt) for dt, n in totals.items()}
        offsets = dict.fromkeys(arenas, 0)
        self.slots: dict[tuple, torch.Tensor] = {}
        for k, (dt, n) in rounded.items():
            self.slots[k] = arenas[dt][offsets[dt]:offsets[dt] + sizes[k][1]]
            offsets[dt] += n


#: the bits of the LM head under ``quantization="int4"`` (4, or 8: int8 per output channel); chosen by
#: benchmarks/int4_accuracy.py (docs/quantization.md)
INT4_LM_HEAD_BITS = 4


def pack_kernel_linear_layers(model: nn.Module, quantization: str = "none", group: int = 0) -> int:
    """Replace every CPU ``nn.Linear`` the CPU kernels cover by a :class:`KernelLinear` (16-bit and float32
    weights), a :class:`~hybridserve.layers.linear_w8.W8Linear` (a checkpoint's 8-bit codes; with
    ``quantization="int8"`` every linear, quantized per output channel, or per ``group`` in-features) or a
    :class:`~hybridserve.layers.linear_w4.W4Linear` (``quantization="int4"``: every linear, a scale per ``group``
    in-features), and pack the experts of every ``FusedExperts`` block likewise; returns how many linears and
    experts were packed. Routers (``quantize = False`` on their linear: their logits pick experts, a discrete
    choice that int8 rounding would flip; llama.cpp keeps them unquantized too) stay 16-bit. The packed weights
    share one allocation per dtype."""
    if not gemm.available():
        return 0
    int4 = quantization == "int4"
    int8 = quantization in ("int8", "w8a8")
    dynamic = quantization == "w8a8"  # activations quantized per row too
    w8_group = 0 if int4 else group  # int4's linears the 4-bit kernel does not take: int8 per output channel
    experts = [m for m in model.modules() if isinstance(m, FusedExperts) and m.packable()]
    linears = [child for _, _, child in _packable_linears(model)]
    sizes: dict[tuple, tuple[torch.dtype, int]] = {}
    w4_keys: set[tuple] = set()  # the weights packed in 4 bits

    def quantized_size(w: torch.Tensor, four_bit: bool) -> tuple[torch.dtype, int]:
        if four_bit:
            w4_keys.add(_key(w))
            return torch.uint8, linear_w4.packed_bytes(*w.shape, group, False, sub_scaled=True)
        return torch.uint8, linear_w8.packed_bytes(*w.shape, w8_group)

    head = getattr(getattr(model, "lm_head", None), "weight", None)
    for lin in linears:
        if is_fp8_linear(lin):
            sizes.setdefault(_key(lin.weight), (torch.uint8, linear_w8.packed_bytes(*lin.weight.shape,
                                                                                     lin.weight_group)))
        elif (int8 or int4) and gemm.packable(lin.weight) and getattr(lin, "quantize", True):
            if _key(lin.weight) not in sizes:
                four_bit = int4 and linear_w4.covers(lin.in_features, group)
                if lin.weight is head and INT4_LM_HEAD_BITS == 8:
                    four_bit = False
                sizes[_key(lin.weight)] = quantized_size(lin.weight, four_bit)
        elif gemm.packable(lin.weight):
            sizes.setdefault(_key(lin.weight), (lin.weight.dtype, gemm.packed_numel(*lin.weight.shape)))
    expert_format: dict[int, torch.dtype | None] = {}
    for block in experts:
        weights = block.expert_weights()
        four_bit = int4 and all(linear_w4.covers(w.shape[1], group) for w in weights)
        expert_format[id(block)] = linear_w4.INT4_FORMAT if four_bit else torch.int8 if int8 or int4 else None
        for w in weights:
            if _key(w) not in sizes:
                sizes[_key(w)] = (quantized_size(w, four_bit) if int8 or int4
                                  else (w.dtype, gemm.packed_numel(*w.shape)))
    slots = _Arena(sizes).slots
    w4_slots = {slots[k].data_ptr() for k in w4_keys}

    def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
        slot = slots.get(_key(weight))
        if slot is None:
            return None
        if slot.data_ptr() in w4_slots:
            codes, scales, supers = quantize_w4_sub(weight, group)
            return linear_w4.pack(codes, scales, None, group, out=slot, supers=(supers, None))
        if slot.dtype == torch.uint8:
            q, scales = quantize_int8(weight, w8_group)
            return linear_w8.pack(q, scales, w8_group, out=slot)
        return gemm.pack(weight, slot)

    def pack_linear(lin: nn.Linear) -> torch.Tensor | None:
        if is_fp8_linear(lin):
            return linear_w8.pack(lin.weight.detach(), lin.weight_scale, lin.weight_group, out=slots[_key(lin.weight)])
        return pack_weight(lin.weight.detach())

    released = [0]  # bytes of checkpoint 8-bit codes freed since the heap was last trimmed

    def make(lin: nn.Linear, packed: torch.Tensor) -> nn.Module:
        if is_fp8_linear(lin):
            layer = W8Linear(lin, packed, lin.weight.dtype, lin.weight_group)
            _release_codes(lin, released)
            return layer
        if packed.data_ptr() in w4_slots:
            return W4Linear(lin.in_features, lin.out_features, packed, group, False, lin.bias, sub_scaled=True)
        if packed.dtype == torch.uint8:
            return W8Linear(lin, packed, torch.int8, w8_group, dynamic_activations=dynamic and w8_group == 0)
        return KernelLinear(lin, packed)

    count = _replace_linears(model, pack_linear, make)
    if released[0]:
        release_free_heap()
    for block in experts:
        fmt = expert_format[id(block)]
        count += block.pack(pack_weight, fmt, group if fmt == linear_w4.INT4_FORMAT else w8_group)
    return count


#: bytes of released 8-bit codes after which the C heap is trimmed (``kernels/heap.py``)
TRIM_EVERY_BYTES = 64 << 20


def _release_codes(linear: nn.Linear, released: list[int]) -> None:
    """Free a packed checkpoint linear's 8-bit codes and scales now (``linear`` itself stays referenced until
    packing ends; a checkpoint's codes are never shared with an unpacked layer), trimming the heap every
    :data:`TRIM_EVERY_BYTES`."""
    weight, scales = linear.weight, linear.weight_scale
    released[0] += weight.numel() * weight.element_size() + scales.numel() * scales.element_size()
    weight.data = weight.data.new_empty(0)
    linear.weight_scale = scales.new_empty(0)
    if released[0] >= TRIM_EVERY_BYTES:
        release_free_heap()
        released[0] = 0


def pack_linear_layers(model: nn.Module, batch_hint: int = 32) -> int:
    """Replace every (remaining) bf16 CPU ``nn.Linear`` by a :class:`PackedLinear`; returns how many."""
    if not prepack_available():
        return 0

    def reorder(linear: nn.Linear) -> torch.Tensor | None:
        weight = linear.weight.detach()
        if weight.dtype != torch.bfloat16:
            return None  # oneDNN's prepack is taken for bf16 only
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)

    return _replace_linears(model, reorder, PackedLinear)


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
