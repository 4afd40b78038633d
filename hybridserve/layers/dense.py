"""``F.linear`` for weights a layer reads directly (routers, Mamba1's dt projection): not packed for the
CPU kernels, and small.

torch's bf16/fp16 CPU matmul falls onto a scalar path where the CPU has no native 16-bit dot
products (0.3 GFLOP/s on AVX2), so 16-bit CPU inputs are multiplied in float32 and the result is
rounded once to the input dtype: what a 16-bit matmul with float32 accumulation gives, up to the
order of the sums.
"""

from __future__ import annotations

import torch
from torch import nn

WIDENED_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T + bias -> (..., out) in x's dtype."""
    if x.device.type == "cpu" and x.dtype in WIDENED_DTYPES:
        b = None if bias is None else bias.float()
        return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)
    return nn.functional.linear(x, weight, bias)
