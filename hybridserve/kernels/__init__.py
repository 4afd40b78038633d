"""Compiled CPU kernels (C++, built on first use), with plain-PyTorch fallbacks in ``hybridserve.ops``."""

from __future__ import annotations

from torch import nn


def enable_cpu_kernels(model: nn.Module) -> bool:
    """Switch every layer of ``model`` that has compiled CPU kernels (a ``use_cpu_kernels`` attribute) to
    them, when they can be built here; returns whether they are on."""
    from hybridserve.kernels import attention, build, pointwise, recurrent

    # builds what is missing, in parallel
    build.load_libraries(["recurrent", "attention", "pointwise", "gemm", "program"])
    if not (recurrent.available() and attention.available() and pointwise.available()):
        return False
    for module in model.modules():
        if hasattr(module, "use_cpu_kernels"):
            module.use_cpu_kernels = True
    return True
