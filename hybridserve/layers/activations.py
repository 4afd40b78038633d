"""Activation modules by their HF config name (``hidden_act``), without importing ``transformers.activations``
for the common ones.

``transformers.activations`` imports transformers' kernel-hub and model-loading machinery (and with it
``torch.distributed``): about a second of a cold start. The names below are, in HF's own table
(``ACT2CLS``), plain PyTorch activations with PyTorch's forward, so the same module class is taken
directly; any other name is looked up in HF's table (``tests/engine/test_startup.py`` checks the two
agree to the bit).
"""

from __future__ import annotations

from torch import nn

#: HF activation name -> the PyTorch module HF's ACT2CLS runs for it (default options)
PLAIN: dict[str, type[nn.Module]] = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
}


def activation(name: str) -> nn.Module:
    """A fresh activation module for HF name ``name`` (``ACT2FN[name]``); KeyError for an unknown name, as HF."""
    cls = PLAIN.get(name)
    if cls is not None:
        return cls()
    from transformers.activations import ACT2FN

    return ACT2FN[name]
