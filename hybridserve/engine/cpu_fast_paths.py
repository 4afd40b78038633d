"""The CPU fast paths an engine runs with: the ISA level, the compiled kernels, the packed linears
and the captured decode steps, each with the reason when it is off.

The engine sets them up at start (:func:`prepare_model`, :func:`attach_captured_decode`), logs one
WARNING line naming every fast path that is off and why (:meth:`CpuFastPaths.log`), and
``hybridserve env --model`` prints :meth:`CpuFastPaths.as_dict`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridserve.config import LOAD_QUANTIZATIONS, EngineConfig
from hybridserve.engine.decode_capture import try_capture
from hybridserve.kernels import enable_cpu_kernels, gemm, isa, linear_w4, linear_w8, unavailable_reason
from hybridserve.kernels.report import w4_variant, w6k_variant, w8_variant
from hybridserve.layers.linear_w4 import W4Linear
from hybridserve.layers.linear_w6k import W6KLinear
from hybridserve.layers.linear_w8 import W8Linear
from hybridserve.layers.packed_linear import (
    copy_remaining_parameters,
    is_fp8_linear,
    pack_kernel_linear_layers,
    pack_linear_layers,
)
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.ops.linear_w6k import dequantize_w6k
from hybridserve.ops.linear_w8 import dequantize

logger = logging.getLogger(__name__)


@dataclass
class CpuFastPaths:
    """What runs fast on this CPU for one engine, and why the rest does not."""

    isa: str  # the ISA level in force
    kernels: bool = False
    kernels_reason: str | None = None
    packed_linears: int = 0  # linears and expert projections on hybridserve's kernels
    onednn_linears: int = 0  # bf16 linears on oneDNN's prepacked matmul
    torch_16bit_linears: int = 0  # 16-bit linears left on torch's matmul
    w8_linears: dict[str, int] = field(default_factory=dict)  # 8-bit linears by code dtype (int8, fp8 e4m3)
    w4_linears: int = 0  # 4-bit linears and expert blocks
    w6k_linears: int = 0  # GGUF Q6_K linears (an LM head among them)
    quantization: str = "none"  # what the engine applied: none, int8, w8a8, int4, fp8 (a checkpoint's fp8 weights)
    decode_captured: bool = False
    decode_reason: str | None = None
    verify_captured: bool | None = None  # speculative verification steps captured (None: no speculation)
    verify_reason: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The JSON form (``hybridserve env``)."""
        return {"cpu_isa": self.isa, "kernels": {"on": self.kernels, "reason": self.kernels_reason},
                "linears": {"hybridserve_kernel": self.packed_linears, "onednn_prepacked": self.onednn_linears,
                            "torch_16bit": self.torch_16bit_linears, "8bit": dict(self.w8_linears)},
                "weights": {"quantization": self.quantization, "kernel": w8_variant() if self.w8_linears else None,
                            **({"4bit": {"linears": self.w4_linears, "kernel": w4_variant()}} if self.w4_linears
                               else {}),
                            **({"q6_k": {"linears": self.w6k_linears, "kernel": w6k_variant()}} if self.w6k_linears
                               else {})},
                "decode": {"captured": self.decode_captured, "reason": self.decode_reason},
                **({} if self.verify_captured is None else
                   {"verify": {"captured": self.verify_captured, "reason": self.verify_reason}})}

    def off(self) -> list[str]:
        """One phrase per fast path that is off, with its reason."""
        out = []
        if not self.kernels:
            out.append(f"compiled CPU kernels off ({self.kernels_reason})")
        if self.torch_16bit_linears:
            out.append(f"{self.torch_16bit_linears} 16-bit linear layers on torch's matmul "
                       f"({'slow on this CPU' if not isa.at_least('avx512') else 'not packed'})")
        if not self.decode_captured:
            out.append(f"decode not captured ({self.decode_reason})")
        if self.verify_captured is False:
            out.append(f"speculative verification not captured ({self.verify_reason})")
        return out + self.notes

    def log(self) -> None:
        """One WARNING line when a fast path is off, else one INFO line."""
        off = self.off()
        if off:
            logger.warning("CPU fast paths at ISA %s: %s", self.isa, "; ".join(off))
        else:
            logger.info("CPU fast paths at ISA %s: kernels, %d packed linears, captured decode", self.isa,
                        self.packed_linears)


def _count_16bit_linears(model: nn.Module) -> int:
    """16-bit ``nn.Linear`` layers left unpacked (those whose weight their layer reads itself, with
    ``prepack = False``, go through ``layers/dense.py`` in float32 and are not counted)."""
    return sum(1 for m in model.modules() if type(m) is nn.Linear and m.weight.dtype in gemm.DTYPES
               and getattr(m, "prepack", True))


def _count_w8_linears(model: nn.Module) -> dict[str, int]:
    """8-bit linears and expert blocks by their codes' dtype name."""
    counts: dict[str, int] = {}
    for m in model.modules():
        fmt = m.fmt if isinstance(m, W8Linear) else getattr(m, "weight_format", None)
        if fmt is not None and fmt != linear_w4.INT4_FORMAT:
            name = "int8" if fmt == torch.int8 else "fp8_e4m3"
            counts[name] = counts.get(name, 0) + 1
    return counts


def _count_w4_linears(model: nn.Module) -> int:
    """4-bit linears and expert blocks."""
    return sum(1 for m in model.modules()
               if isinstance(m, W4Linear) or getattr(m, "weight_format", None) == linear_w4.INT4_FORMAT)


def _dequantize_unpacked_fp8(model: nn.Module, report: CpuFastPaths) -> None:
    """Give the 8-bit (fp8 or int8) linears the kernels did not pack (kernels unavailable) dequantized weights."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype.itemsize > 1),
                 torch.float32)
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear and is_fp8_linear(m):
            m.weight.data = dequantize(m.weight.data, m.weight_scale, m.weight_group).to(dtype)
            del m.weight_scale, m.weight_group
            count += 1
    if count:
        report.notes.append(f"{count} 8-bit (fp8 or int8) linears dequantized to {dtype} "
                            "(the 8-bit kernel is not available)")


def _dequantize_q6k_linears(model: nn.Module, dtype: torch.dtype, report: CpuFastPaths) -> None:
    """Without the kernels, give every Q6_K linear (a GGUF file's) a plain ``nn.Linear`` over its dequantized weight
    in the model dtype ``dtype``, so that no call dequantizes it again; a tied LM head is then tied to the embedding
    again (the same values: the embedding was dequantized from the same blocks)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, W6KLinear):
                with torch.device("meta"):
                    linear = nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight = nn.Parameter(dequantize_w6k(*child.unpacked()).to(dtype), requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)
                count += 1
    if count:
        tie = getattr(model, "tie_weights_if_needed", None)
        if callable(tie):
            tie()
        report.notes.append(f"{count} Q6_K linears dequantized to {dtype} (the Q6_K kernel is not available)")


def prepare_model(model: nn.Module, config: EngineConfig) -> CpuFastPaths:
    """Cap the ISA, switch the model's layers to the compiled kernels and pack its 16-bit linears."""
    level = isa.set_cap(config.cpu_isa)
    isa.cap_torch(config.cpu_isa)  # effective only if torch has not dispatched a CPU kernel yet
    report = CpuFastPaths(isa=level)
    if config.cpu_isa != "auto" and not isa.torch_capability_within(level):
        report.notes.append(f"ATen runs at {torch.backends.cpu.get_cpu_capability()} above the cap {level} "
                            "(it was fixed before the engine started; pass --cpu-isa on the command line or set "
                            "ATEN_CPU_CAPABILITY before importing torch)")
    if not config.cpu_kernels:
        report.kernels_reason = "--no-cpu-kernels"
    else:
        report.kernels = enable_cpu_kernels(model)
        if not report.kernels:
            report.kernels_reason = unavailable_reason() or "a kernel library did not load"
    if config.quantization in LOAD_QUANTIZATIONS and not report.kernels:
        raise ValueError(f"quantization={config.quantization!r} needs the compiled CPU kernels, which are off here "
                         f"({report.kernels_reason})")
    if report.kernels:
        group = config.int4_group_size() if config.quantization == "int4" else 0
        report.packed_linears = pack_kernel_linear_layers(model, config.quantization, group)
        report.w8_linears = _count_w8_linears(model)
        report.w4_linears = _count_w4_linears(model)
        report.w6k_linears = sum(1 for m in model.modules() if isinstance(m, W6KLinear))
        report.quantization = (config.quantization if config.quantization in LOAD_QUANTIZATIONS
                               else "fp8" if report.w8_linears else "none")
        if config.quantization == "w8a8" and linear_w8.w8a8_sums() == "integer vectors":
            logger.warning("quantization='w8a8' at ISA %s sums on integer vectors (no AVX-512 VNNI or AMX-INT8 "
                           "below avx512_bf16), about 100 GFLOP/s on 2 cores: slower than 'int8' or bf16 for "
                           "batched steps (docs/quantization.md)", report.isa)
    _dequantize_unpacked_fp8(model, report)
    if not report.kernels and hasattr(model, "hf_config"):  # (a GGUF file's model: a CausalLM)
        _dequantize_q6k_linears(model, config.resolve_dtypes(model.hf_config).model, report)
    if config.cpu_weight_prepack:
        report.onednn_linears = pack_linear_layers(model)  # the bf16 linears the kernels do not take
    if report.packed_linears or report.onednn_linears:
        copy_remaining_parameters(model)  # lets the checkpoint's memory map go
    report.torch_16bit_linears = _count_16bit_linears(model)
    return report


def attach_captured_decode(runner, model: nn.Module, pool, config: EngineConfig, max_model_len: int,
                           report: CpuFastPaths, eager_reason: str | None = None) -> None:
    """Capture the model's decode steps into ``runner`` where they can be, recording why not otherwise
    (``eager_reason``: the engine's own reason not to, such as tensor parallelism). With the kernels on,
    RoPE tables for every position up to ``max_model_len`` are made first (eager steps gather from them too)."""
    if report.kernels:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.make_table(max_model_len, dtype)
    if not report.kernels:
        report.decode_reason = f"the compiled CPU kernels are off ({report.kernels_reason})"
    elif config.enforce_eager:
        report.decode_reason = "--enforce-eager"
    elif eager_reason is not None:
        report.decode_reason = eager_reason
    else:
        runner.captured_decode, report.decode_reason = try_capture(model, pool, config.max_num_seqs, max_model_len,
                                                                   caches=runner.caches)
        report.decode_captured = runner.captured_decode is not None


def attach_captured_steps(runner, model: nn.Module, pool, max_model_len: int, report: CpuFastPaths,
                          max_rows: int, max_tokens_per_row: int) -> None:
    """Capture the steps of 2 to ``max_tokens_per_row`` tokens per sequence (speculative verifications
    and the reruns after a rejected draft) for up to ``max_rows`` sequences into ``runner``, where the
    decode is captured; otherwise they run eagerly, with the reason recorded."""
    if runner.captured_decode is None:
        report.verify_captured, report.verify_reason = False, f"decode is not captured ({report.decode_reason})"
        return
    for q in range(2, max_tokens_per_row + 1):
        captured, reason = try_capture(model, pool, max_rows, max_model_len, q, runner.caches)
        if captured is None:
            runner.captured_steps.clear()
            report.verify_captured, report.verify_reason = False, reason
            return
        runner.captured_steps[q] = captured
    report.verify_captured, report.verify_reason = True, None
