"""Compiled CPU kernels (C++, built on first use), with plain-PyTorch fallbacks in ``hybridserve.ops``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when kernels are used (the CLI caps its ISA before that)
    from torch import nn


LIBRARIES = ["recurrent", "attention", "pointwise", "gemm", "graph"]


def unavailable_reason() -> str | None:
    """Why some kernel library cannot be used at the ISA level in force (None when all can)."""
    from hybridserve.kernels import build, isa

    level = isa.level_in_force()
    reasons = {name: build.unavailable_reason(name, level) for name in LIBRARIES}
    return "; ".join(f"{name}: {why}" for name, why in reasons.items() if why is not None) or None


def enable_cpu_kernels(model: "nn.Module") -> bool:
    """Run every call of ``model`` on the compiled CPU kernels (``ops.dispatch.run_on_kernels``), when they
    can be built here; returns whether they are on."""
    from hybridserve.kernels import attention, build, pointwise, recurrent
    from hybridserve.ops.dispatch import run_on_kernels

    # builds what is missing, in parallel
    build.load_libraries(LIBRARIES)
    if not (recurrent.available() and attention.available() and pointwise.available()):
        return False
    run_on_kernels(model)
    return True
