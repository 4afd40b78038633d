"""Cache specs: what each layer needs cached, in which dtype.

Every layer that caches anything declares one :class:`LayerCacheSpec`. The pool, block manager,
planner and runner only ever see specs; no model builds a cache of its own. Dtypes are torch dtypes in
the engine and may be their names in a plan (``planning/plan_config.py`` resolves dtype names).

* Attention KV is per token: ``AttentionSpec(num_kv_heads, head_size, dtype)`` stores K and V,
  each ``(num_kv_heads, head_size)`` per token, in pages of ``block_size`` tokens.
* Recurrent state is per sequence: a tuple of named ``StateTensorSpec(name, shape, dtype)``.
  A state tensor has a role, ``conv`` (follows ``mamba_cache_dtype``) or ``temporal``
  (follows ``mamba_ssm_cache_dtype``), resolved by the layer through :class:`CacheDtypes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hybridserve.cache.dtypes import STATE_SCALE_DTYPE, dtype_name, dtype_size, is_coded_state_dtype

if TYPE_CHECKING:
    import torch

#: a torch dtype (the engine's specs) or its name (a plan's): see cache/dtypes.py
DType = Any
#: the name of an 8-bit state tensor's row scales is its own name and this
SCALE_SUFFIX = "_scale"
#: the dtype of an 8-bit conv state's per-channel power-of-two exponents (cache/conv_codec.py)
CONV_EXPONENT_DTYPE = "int8"
#: the state kinds whose 8-bit codes round to nearest (the others round stochastically): measured, mean |Δlogprob|
#: against float32 state over 520 + 520 tokens, int8 nearest over int8 stochastic: the gated delta net 0.62-0.87x
#: (Qwen3-Next, Qwen3.5, OLMo-Hybrid), KDA 0.90x, mLSTM 0.72x; Mamba1 1.16-1.59x, Mamba2 1.14x on the trained
#: default model (0.68-1.02x on tiny random ones), linear attention 1.38x (docs/state_precision.md, "Rounding")
TEMPORAL_ROUNDING = {"gated_delta_net": "nearest", "kda": "nearest", "mlstm": "nearest"}
#: the dtype of a stabilizer state (mLSTM's ``m``) beside 8-bit codes
STABILIZER_BESIDE_CODES_DTYPE = "float32"

__all__ = ["AttentionSpec", "CacheDtypes", "LatentAttentionSpec", "LayerCacheSpec", "ResolvedDtypes", "StateTensorSpec",
           "dtype_size"]


@dataclass(frozen=True)
class AttentionSpec:
    """Per-token K and V of one attention layer."""

    num_kv_heads: int
    head_size: int
    dtype: DType
    sliding_window: int | None = None
    #: the per-token tensors stored, each ``(num_kv_heads, head_size)``
    tensor_names: ClassVar[tuple[str, ...]] = ("k", "v")

    @property
    def bytes_per_token(self) -> int:
        """K plus V bytes for one token."""
        return len(self.tensor_names) * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class LatentAttentionSpec(AttentionSpec):
    """Multi-head latent attention (MLA): one compressed latent per token, ``kv_lora_rank`` normed
    latent dims then ``rope_dim`` shared key dims, stored once as ``latent`` ``(1, head_size)`` in
    the same 16-token pages as K/V (no K, no V). Build it with :meth:`CacheDtypes.latent_attention`."""

    rope_dim: int = 0
    tensor_names: ClassVar[tuple[str, ...]] = ("latent",)


@dataclass(frozen=True)
class StateTensorSpec:
    """One named recurrent-state tensor, shape per sequence.

    In an 8-bit dtype (``int8``, ``float8_e4m3fn``: :func:`~hybridserve.cache.dtypes.is_coded_state_dtype`) the
    tensor is stored as codes of ``shape`` plus a scale per row, ``scale_shape = shape[:-1]``: a bfloat16 scale
    (a temporal state: cache/state_codec.py), or with ``exponent_scales`` an int8 power-of-two exponent (a conv
    state ``(D, K-1)``, a row per channel: cache/conv_codec.py); both live in the slot and ``nbytes`` counts
    both."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    #: with tensor parallelism, the flat index of this rank's first element in the whole per-sequence tensor (a
    #: rank holds a contiguous slice of the first axis, its heads): 8-bit state numbers its rounding noise from it,
    #: so every rank rounds its elements as one rank would
    shard_offset: int = 0
    #: a conv state: 8-bit codes take an int8 power-of-two exponent per row (cache/conv_codec.py), not a bfloat16
    #: scale
    exponent_scales: bool = False
    #: how 8-bit codes of a temporal state are rounded: ``"stochastic"`` (seeded noise) or ``"nearest"``, chosen per
    #: state kind by measurement (:data:`TEMPORAL_ROUNDING`; docs/state_precision.md, "Rounding")
    rounding: str = "stochastic"

    @property
    def coded(self) -> bool:
        """Whether the tensor is stored as 8-bit codes plus row scales."""
        return is_coded_state_dtype(self.dtype)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The shape of the row scales (one per row: every axis but the last)."""
        return tuple(self.shape[:-1])

    @property
    def scale_dtype(self) -> str:
        """The dtype of the row scales: bfloat16, or int8 exponents (``exponent_scales``)."""
        return CONV_EXPONENT_DTYPE if self.exponent_scales else STATE_SCALE_DTYPE

    @property
    def scale_name(self) -> str:
        """The name of the scale tensor in a slot's layout and in ``describe()``."""
        return self.name + SCALE_SUFFIX

    @property
    def code_nbytes(self) -> int:
        """Bytes of the values (the codes of a coded tensor)."""
        return math.prod(self.shape) * dtype_size(self.dtype)

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the row scales (0 for a float tensor)."""
        return math.prod(self.scale_shape) * dtype_size(self.scale_dtype) if self.coded else 0

    @property
    def nbytes(self) -> int:
        """Exact bytes of one sequence's tensor: codes and scales."""
        return self.code_nbytes + self.scale_nbytes


@dataclass(frozen=True)
class LayerCacheSpec:
    """Everything one layer caches: optional attention KV and any number of state tensors."""

    index: int
    kind: str
    attention: AttentionSpec | None = None
    state: tuple[StateTensorSpec, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Exact K+V bytes of one token of this layer (0 without attention)."""
        return self.attention.bytes_per_token if self.attention is not None else 0

    @property
    def state_bytes_per_sequence(self) -> int:
        """Exact recurrent-state bytes of one sequence of this layer."""
        return sum(t.nbytes for t in self.state)

    def describe(self) -> dict:
        """The ``layers`` entry of ``cache_layout()`` and of ``hybridserve plan --json``.

        K/V tensors are per token (``shape`` without the token axis, ``bytes`` per token); state
        tensors are per sequence. An 8-bit state tensor is two entries: its codes (with ``"rounding"``:
        ``"stochastic"`` or ``"nearest"``), then its scales (``"<name>_scale"``: :data:`SCALE_SUFFIX`, bfloat16, or
        int8 exponents for a conv state, with ``"scales": "<name>"``).
        """
        tensors = []
        if self.attention is not None:
            a = self.attention
            for name in a.tensor_names:
                tensors.append({"name": name, "shape": [a.num_kv_heads, a.head_size], "dtype": dtype_name(a.dtype),
                                "per": "token", "bytes": a.bytes_per_token // len(a.tensor_names)})
        for t in self.state:
            entry = {"name": t.name, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "per": "sequence",
                     "bytes": t.code_nbytes}
            if t.coded:  # how its codes round: stochastic or nearest for a temporal state, nearest for a conv state
                entry["rounding"] = "nearest" if t.exponent_scales else t.rounding
            tensors.append(entry)
            if t.coded:  # the row scales of 8-bit codes, beside them in the slot
                tensors.append({"name": t.scale_name, "shape": list(t.scale_shape), "dtype": t.scale_dtype,
                                "per": "sequence", "bytes": t.scale_nbytes, "scales": t.name})
        return {"index": self.index, "kind": self.kind, "tensors": tensors,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_bytes_per_sequence": self.state_bytes_per_sequence}


@dataclass(frozen=True)
class ResolvedDtypes:
    """The concrete dtypes an engine runs with (``EngineConfig.resolve_dtypes``; re-exported by ``config``)."""

    model: torch.dtype
    kv_cache: torch.dtype
    conv_state: torch.dtype
    ssm_state: torch.dtype

    def as_names(self) -> dict[str, str]:
        """The four dtype options' names of these dtypes, as the config fingerprint records them."""
        return {
            "dtype": dtype_name(self.model),
            "kv_cache_dtype": dtype_name(self.kv_cache),
            "mamba_cache_dtype": dtype_name(self.conv_state),
            "mamba_ssm_cache_dtype": dtype_name(self.ssm_state),
        }


@dataclass(frozen=True)
class CacheDtypes:
    """The dtypes a layer uses to build its spec: by role, never by model."""

    kv: DType
    conv: DType
    temporal: DType

    @classmethod
    def from_resolved(cls, resolved: ResolvedDtypes) -> "CacheDtypes":
        return cls(kv=resolved.kv_cache, conv=resolved.conv_state, temporal=resolved.ssm_state)

    def conv_state(self, name: str, shape: tuple[int, ...]) -> StateTensorSpec:
        """A conv window ``(D, K-1)`` in the conv-state dtype (in 8 bits: an exponent per channel)."""
        return StateTensorSpec(name, tuple(shape), self.conv, exponent_scales=True)

    def temporal_state(self, name: str, shape: tuple[int, ...], kind: str | None = None) -> StateTensorSpec:
        """A recurrent state in the temporal dtype; ``kind`` (a :data:`TEMPORAL_ROUNDING` key, e.g. ``"mlstm"``)
        picks how its 8-bit codes are rounded (stochastically when not named there)."""
        rounding = TEMPORAL_ROUNDING.get(kind, "stochastic") if kind is not None else "stochastic"
        return StateTensorSpec(name, tuple(shape), self.temporal, rounding=rounding)

    def stabilizer_state(self, name: str, shape: tuple[int, ...]) -> StateTensorSpec:
        """A temporal state in log space that rescales the others (mLSTM's running max ``m``): the temporal
        dtype when that is a float one, float32 beside 8-bit codes (an error in it would rescale the
        coded states' every row at once, and it is a few bytes)."""
        return StateTensorSpec(name, tuple(shape), STABILIZER_BESIDE_CODES_DTYPE if is_coded_state_dtype(self.temporal)
                               else self.temporal)

    def attention(self, num_kv_heads: int, head_size: int, sliding_window: int | None = None) -> AttentionSpec:
        return AttentionSpec(num_kv_heads, head_size, self.kv, sliding_window)

    def latent_attention(self, kv_lora_rank: int, rope_dim: int) -> LatentAttentionSpec:
        """MLA's per-token latent (``kv_lora_rank + rope_dim`` values) in the KV dtype."""
        return LatentAttentionSpec(1, kv_lora_rank + rope_dim, self.kv, None, rope_dim)
