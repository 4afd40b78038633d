"""The GGUF entry points of the checkpoint loader (``models/loader.py``): the config of a file, and its tensors under
checkpoint names, with the linear weights of the block types kept quantized."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from hybridserve.layers.linear_w4 import W4Linear
from hybridserve.layers.linear_w6k import W6KLinear
from hybridserve.models.gguf import configs, reader, tensors
from hybridserve.models.gguf.coded import CodedWeight


def gguf_config(file: str) -> Any:
    """The transformers config of a GGUF file (``configs.hf_config``), after its tensor types are checked
    (``reader.check_types``); each problem is a one-line ValueError naming the file."""
    r = reader.open_gguf(file)
    reader.check_types(r, file)
    config = configs.hf_config(reader.metadata(r), reader.tensor_types(r), reader.tensor_shapes(r), file)
    config.architectures = [_architecture(config)]
    return config


def _architecture(config: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]


class _Tensors:
    """The tensors of one file read like a safetensors file (``get_tensor``): each converted when asked for and
    not kept here, so the loader holds only what it has not installed yet."""

    def __init__(self, values: tensors.CheckpointTensors) -> None:
        self.values = values

    def get_tensor(self, name: str) -> tensors.Value:
        return self.values.get(name)


def gguf_checkpoint_tensors(file: str, hf_config: Any, renames, skip: str | None
                            ) -> Iterator[tuple[_Tensors, str, str]]:
    """``(source, checkpoint name, renamed name)`` of every tensor of the file, as ``loader.checkpoint_tensors``
    gives them for safetensors; ``source.get_tensor(name)`` reads and converts the tensor then (a float tensor or
    a :class:`CodedWeight`)."""
    import re

    from hybridserve.models.loader import _rename

    r = reader.open_gguf(file)
    arch = str(reader.metadata(r).get("general.architecture"))
    values = tensors.checkpoint_tensors(r, arch, hf_config, file)
    source = _Tensors(values)
    for raw in values.names():
        if skip is None or not re.match(skip, raw):
            yield source, raw, _rename(raw, renames)


def install_coded(owner: Any, attr: str, parent: nn.Module, child: str, weight: CodedWeight,
                  device: torch.device) -> None:
    """Put a coded weight into the ``nn.Linear`` ``owner`` (``parent.<child>``): 8-bit as int8 codes with
    ``weight_scale`` and ``weight_group`` (packed later for the 8-bit kernel, ``layers/packed_linear.py``), 4-bit
    by replacing the layer with a :class:`~hybridserve.layers.linear_w4.W4Linear` (the 4-bit kernel's packed
    layout: Q4_0's float16 scales as they are, Q4_K's scales and mins sub-scaled, both exactly),
    Q6_K by replacing it with a :class:`~hybridserve.layers.linear_w6k.W6KLinear` (its values exactly)."""
    bias = None if owner.bias is None else owner.bias.data
    if weight.bits == 6:
        assert weight.super_scales is not None
        setattr(parent, child, W6KLinear.from_codes(weight.codes.to(device), weight.scales.to(device),
                                                     weight.super_scales.to(device), bias))
        return
    if weight.bits == 8:
        setattr(owner, attr, nn.Parameter(weight.codes.to(device), requires_grad=False))  # int8: no gradient
        owner.weight_scale, owner.weight_group = weight.scales.to(device), weight.group
        return
    supers = None if weight.super_scales is None else (
        weight.super_scales.to(device), None if weight.super_mins is None else weight.super_mins.to(device))
    layer = W4Linear.from_codes(owner.in_features, owner.out_features, weight.codes.to(device),
                                weight.scales.to(device), None if weight.mins is None else weight.mins.to(device),
                                weight.group, bias, supers=supers)
    setattr(parent, child, layer)
