"""``ops/prepared.py``: a kernel's form of a layer's parameters is built once and rebuilt only when a
parameter's storage (or an extra key) changes."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.ops.prepared import prepared


def test_built_once_per_storage_and_rebuilt_when_a_parameter_is_replaced():
    layer = nn.Linear(4, 3)
    builds = []

    def build():
        builds.append(1)
        return layer.weight.detach().float().t().contiguous()

    first = prepared(layer, "_t", (layer.weight, layer.bias), build)
    assert prepared(layer, "_t", (layer.weight, layer.bias), build) is first and len(builds) == 1
    assert "_t" not in layer.state_dict()  # kept beside the parameters, never saved with them
    layer.weight = nn.Parameter(torch.ones(3, 4))  # a reload into new storage
    second = prepared(layer, "_t", (layer.weight, layer.bias), build)
    assert len(builds) == 2 and torch.equal(second, torch.ones(4, 3))


def test_an_extra_key_and_a_missing_source_take_part_in_the_key():
    layer = nn.Conv1d(2, 2, 3, groups=2, bias=False)
    made = [prepared(layer, "_p", (layer.weight, layer.bias), lambda d=d: torch.zeros(1, dtype=d), d)
            for d in (torch.float32, torch.bfloat16, torch.bfloat16)]
    assert [m.dtype for m in made] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert made[2] is made[1] and made[1] is not made[0]
