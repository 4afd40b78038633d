"""FalconMamba: Mamba1 with weightless RMS norms on dt, B and C inside the mixer (``mixer_rms_eps``)."""

from __future__ import annotations

from hybridserve.models.mamba import MambaLMBase


class FalconMambaLM(MambaLMBase):
    """FalconMamba (registered under its HF architecture name in ``models/registry.py``)."""

    checkpoint_renames: list[tuple[str, str]] = []
    bcdt_norm = "weightless"
