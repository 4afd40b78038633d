"""A GGUF file's tensors under the names and in the layout of the transformers checkpoint they were converted from.

Names: llama.cpp's own tables (``gguf.TensorNameMap``) map a checkpoint name to a GGUF name; read backwards they
give, for a GGUF name, the checkpoint names of every family that writes it, and the one the transformers model of
this config has is taken. What the tables do not cover (a projection llama.cpp splits in two, a tensor it files
under another family's name) each architecture lists in :data:`RULES`.

Values: llama.cpp's converter transforms some tensors; each is undone here:

* Mamba's ``A_log`` is written as ``A = -exp(A_log)``: read back as ``log(-A)``;
* squeezed, unsqueezed or regrouped tensors (conv1d weights, Mamba2's A, D and grouped norm): reshaped to the
  checkpoint's shape when the element count is the same;
* q and k rows permuted for llama.cpp's rope layout (llama-style attention): permuted back;
* a projection split in two (Granite's fused gate and up): its parts stacked again;
* Qwen3.5's value heads, reordered from grouped by key head to tiled over the key heads: put back in groups.

The multi-token-prediction layers the converter appends after the model's layers (``nextn_predict_layers``) are
not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridserve.models.gguf.coded import CodedWeight, cat_rows
from hybridserve.models.gguf.reader import read_released

Value = torch.Tensor | CodedWeight
BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ArchRules:
    """What llama.cpp's name tables leave out for one architecture. Names are relative to a layer: GGUF ones
    without ``blk.N.``, checkpoint ones with ``{bid}`` for the layer index."""

    gguf_arch: str  # the gguf.MODEL_ARCH member
    # GGUF name (``ffn_down``: any suffix kept; ``ffn_up_exps.weight``: that tensor alone) -> checkpoint name
    renames: dict[str, str] = field(default_factory=dict)
    merges: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (checkpoint name, the GGUF parts stacked into it)
    permute_qk: bool = False  # q/k rows in llama.cpp's rope layout
    norm_offset: bool = False  # RMS norm weights written as 1 + w (Qwen3-Next's, but the gated delta net's own)
    tiled_value_heads: bool = False  # gated delta net value heads tiled over the key heads (Qwen3.5)


_GRANITE_MERGES = (
    ("model.layers.{bid}.block_sparse_moe.input_linear.weight", ("ffn_gate_exps.weight", "ffn_up_exps.weight")),
    ("model.layers.{bid}.shared_mlp.input_linear.weight", ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")),
    ("model.layers.{bid}.shared_mlp.input_linear.weight", ("ffn_gate.weight", "ffn_up.weight")),  # no experts
)

RULES: dict[str, ArchRules] = {
    "llama": ArchRules("LLAMA", permute_qk=True),
    "mamba": ArchRules("MAMBA"),
    "mamba2": ArchRules("MAMBA2"),
    "granitehybrid": ArchRules(
        "GRANITE_HYBRID", permute_qk=True,
        renames={"ffn_down": "model.layers.{bid}.shared_mlp.output_linear",
                 "ffn_down_shexp": "model.layers.{bid}.shared_mlp.output_linear",
                 "ffn_down_exps": "model.layers.{bid}.block_sparse_moe.output_linear",
                 "ffn_gate_inp": "model.layers.{bid}.block_sparse_moe.router.layer"},
        merges=_GRANITE_MERGES),
    "nemotron_h": ArchRules("NEMOTRON_H", permute_qk=True),
    "nemotron_h_moe": ArchRules(
        "NEMOTRON_H_MOE", permute_qk=True,
        renames={"ffn_up_exps.weight": "model.layers.{bid}.mixer.experts.up_proj",
                 "ffn_down_exps.weight": "model.layers.{bid}.mixer.experts.down_proj",
                 "exp_probs_b.bias": "model.layers.{bid}.mixer.gate.e_score_correction_bias"}),
    "falcon-h1": ArchRules("FALCON_H1"),
    "jamba": ArchRules(
        "JAMBA",
        renames={"ffn_down_exps.weight": "model.layers.{bid}.feed_forward.experts.down_proj",
                 "ffn_gate_inp.weight": "model.layers.{bid}.feed_forward.router.weight"},
        merges=(("model.layers.{bid}.feed_forward.experts.gate_up_proj",
                 ("ffn_gate_exps.weight", "ffn_up_exps.weight")),)),
    "lfm2": ArchRules("LFM2"),
    "qwen3next": ArchRules(
        "QWEN3NEXT", norm_offset=True,
        renames={"ffn_down_exps.weight": "model.layers.{bid}.mlp.experts.down_proj"},
        merges=(("model.layers.{bid}.mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight")),
                ("model.layers.{bid}.linear_attn.in_proj_qkvz.weight", ("attn_qkv.weight", "attn_gate.weight")))),
    "lfm2moe": ArchRules(
        "LFM2MOE",
        renames={"ffn_down_exps.weight": "model.layers.{bid}.feed_forward.experts.down_proj",
                 "exp_probs_b.bias": "model.layers.{bid}.feed_forward.expert_bias"},
        merges=(("model.layers.{bid}.feed_forward.experts.gate_up_proj",
                 ("ffn_gate_exps.weight", "ffn_up_exps.weight")),)),
    "qwen35": ArchRules("QWEN35", norm_offset=True, tiled_value_heads=True),
    "qwen35moe": ArchRules(
        "QWEN35MOE", norm_offset=True, tiled_value_heads=True,
        renames={"ffn_down_exps.weight": "model.layers.{bid}.mlp.experts.down_proj"},
        merges=(("model.layers.{bid}.mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight")),)),
}


def checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the transformers model of ``hf_config`` (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def reverse_names(gguf_arch: str, layers: int) -> dict[str, list[str]]:
    """GGUF base name (``blk.3.ssm_in``) -> the checkpoint base names llama.cpp's tables map to it."""
    import gguf

    table = gguf.TensorNameMap(getattr(gguf.MODEL_ARCH, gguf_arch), layers)
    out: dict[str, list[str]] = {}
    for hf_name, (_, gguf_name) in table.mapping.items():
        out.setdefault(gguf_name, []).append(hf_name)
    return out


def checkpoint_renamings(model_type: str) -> list[tuple[str, str]]:
    """transformers' renames of this family's checkpoint names to its model's (``backbone.`` -> ``model.`` for
    Nemotron-H): llama.cpp's tables hold the checkpoint names, the shapes come from the model."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping
    except ImportError:
        return []
    out: list[tuple[str, str]] = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(rule, WeightRenaming):
            out.extend(zip(rule.source_patterns, rule.target_patterns))
    return out


def _candidates(name: str, reverse: dict[str, list[str]], shapes: dict[str, tuple[int, ...]],
                renamings: list[tuple[str, str]]) -> list[str]:
    base, dot, suffix = name.rpartition(".")
    found: list[str] = []
    for key, tail in ((base, "." + suffix), (name, "")) if dot else ((name, ""),):
        for hf in reverse.get(key, ()):
            for option in (hf + tail, re.sub(r"\.dt_proj\.bias$", ".dt_bias", hf + tail)):
                named = _in_model(option, shapes, renamings)
                if named is not None and named not in found:
                    found.append(named)
    return found


def _in_model(name: str, shapes: dict[str, tuple[int, ...]], renamings: list[tuple[str, str]]) -> str | None:
    """``name`` as the model names it (itself, or through transformers' renames), None when it has no such tensor."""
    if name in shapes:
        return name
    for source, target in renamings:
        name = re.sub(source, target, name)
    return name if name in shapes else None


def _rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (``permute`` in its llama converter) of a
    (heads * head_dim, ...) weight: checkpoint row ``i`` is GGUF row ``order[i]``."""
    forward = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(forward)


def _unpermute(value: Value, heads: int) -> Value:
    return _rows(value, _rope_rows(value.shape[0], heads))


def _rows(value: Value, order: torch.Tensor) -> Value:
    """``value``'s rows in ``order``."""
    return value.rows(order) if isinstance(value, CodedWeight) else value[order]


def _qkvz_rows(config: Any) -> torch.Tensor:
    """The row order that rebuilds Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, v, z) from llama.cpp's
    ``attn_qkv`` (all q, all k, all v) stacked over ``attn_gate`` (all z)."""
    nk, hk = config.linear_num_key_heads, config.linear_key_head_dim
    vz = config.linear_num_value_heads // nk * config.linear_value_head_dim  # v (and z) rows per key head
    q = torch.arange(nk * hk).reshape(nk, hk)
    k = q + nk * hk
    v = torch.arange(nk * vz).reshape(nk, vz) + 2 * nk * hk
    z = v + nk * vz
    return torch.cat([q, k, v, z], dim=1).reshape(-1)


def _grouped_heads(config: Any, head_dim: int) -> torch.Tensor:
    """The order that puts Qwen3.5's value heads (each ``head_dim`` wide) back in groups by key head: llama.cpp's
    converter tiles them (v0 of every key head, then v1, ...); checkpoint index ``i`` is GGUF index
    ``order[i]``."""
    nk = config.linear_num_key_heads
    per_key = config.linear_num_value_heads // nk
    tiled = torch.arange(per_key * nk * head_dim).reshape(per_key, nk, head_dim)
    return tiled.transpose(0, 1).reshape(-1)


def _untile_value_heads(name: str, value: Value, config: Any) -> Value:
    """Qwen3.5's gated-delta-net tensors with their value heads grouped by key head again (module docstring)."""
    hv = config.linear_value_head_dim
    qk = 2 * config.linear_num_key_heads * config.linear_key_head_dim  # q and k channels, not reordered
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        order = torch.cat([torch.arange(qk), qk + _grouped_heads(config, hv)])
    elif name.endswith("in_proj_z.weight"):
        order = _grouped_heads(config, hv)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        order = _grouped_heads(config, 1)
    elif name.endswith("out_proj.weight"):
        columns = value.dequantize() if isinstance(value, CodedWeight) else value
        return columns[:, _grouped_heads(config, hv)]
    else:
        return value
    return _rows(value, order)


def _stack(parts: list[Value], shape: tuple[int, ...]) -> Value:
    """Parts of one projection stacked along their output rows (dim -2 of ``shape``)."""
    if len(shape) == 2 and all(isinstance(p, CodedWeight) for p in parts):
        coded = [p for p in parts if isinstance(p, CodedWeight)]
        if all(coded[0].matches(p) for p in coded[1:]):
            return cat_rows(coded)
    floats = [(p.dequantize() if isinstance(p, CodedWeight) else p.float()) for p in parts]
    floats = [f.reshape(*shape[:-2], -1, shape[-1]) for f in floats]
    return torch.cat(floats, dim=-2)


def fit(name: str, value: Value, shape: tuple[int, ...], file: str) -> Value:
    """``value`` in the checkpoint's ``shape``: a CodedWeight stays one when it is a 2-D weight of that shape, else
    it is dequantized; a tensor of the same element count is reshaped. Anything else is a ValueError."""
    if isinstance(value, CodedWeight):
        if tuple(value.shape) == shape:
            return value
        value = value.dequantize()
    if tuple(value.shape) != shape:
        if value.numel() != torch.Size(shape).numel():
            raise ValueError(f"{file}: tensor for {name} has shape {tuple(value.shape)}, the model needs {shape}")
        value = value.reshape(shape)
    return value


def _field_int(reader: Any, key: str) -> int:
    """An integer metadata field of the file (0 when absent)."""
    field = reader.fields.get(key)
    return int(field.contents()) if field is not None else 0


class CheckpointTensors:
    """The tensors of one file under their checkpoint names, each read and converted only when asked for
    (:meth:`get`), so that a loader holds one converted tensor at a time: nothing is cached here."""

    def __init__(self, reader: Any, parts: dict[str, tuple[Any, ...]], rules: ArchRules, hf_config: Any,
                 shapes: dict[str, tuple[int, ...]], file: str) -> None:
        self.reader, self.parts, self.rules = reader, parts, rules
        self.hf_config, self.shapes, self.file = hf_config, shapes, file

    def names(self) -> list[str]:
        """Every checkpoint name the file gives, in file order."""
        return list(self.parts)

    def get(self, name: str) -> Value:
        """The tensor ``name``: its GGUF tensors read (their file pages released), stacked when the converter
        split it, the transforms undone (module docstring)."""
        values = [read_released(self.reader, tensor) for tensor in self.parts[name]]
        value = values[0] if len(values) == 1 else _stack(values, self.shapes[name])
        del values
        return _undo(name, value, self.rules, self.hf_config, self.shapes[name], self.file)


def checkpoint_tensors(reader: Any, arch: str, hf_config: Any, file: str) -> CheckpointTensors:
    """Every tensor of the file under its checkpoint name (names resolved now, values read on demand)."""
    rules = RULES[arch]
    shapes = checkpoint_shapes(hf_config)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or len(hf_config.layers_block_type))
    mtp_layers = _field_int(reader, f"{arch}.nextn_predict_layers")
    reverse = reverse_names(rules.gguf_arch, layers)
    renamings = checkpoint_renamings(hf_config.model_type)
    parts_of = {part: target for target, parts in rules.merges for part in parts}
    pending: dict[str, dict[str, Any]] = {}
    out: dict[str, tuple[Any, ...]] = {}
    unmatched: list[str] = []
    for tensor in reader.tensors:
        name = tensor.name
        block = BLOCK.match(name)
        bid, local = (block.group(1), block.group(2)) if block else (None, name)
        if bid is not None and int(bid) >= layers and mtp_layers:
            continue  # a multi-token-prediction layer appended by the converter: not loaded
        local_base, _, suffix = local.rpartition(".")
        merged = _in_model(parts_of[local].format(bid=bid), shapes, renamings) if bid is not None and (
            local in parts_of) else None
        if merged is not None:
            pending.setdefault(merged, {})[local] = tensor
            continue
        target = None
        if bid is not None and (local in rules.renames or local_base in rules.renames):
            candidate = (rules.renames[local] if local in rules.renames
                         else rules.renames[local_base] + "." + suffix).format(bid=bid)
            target = _in_model(candidate, shapes, renamings)
        if target is None:
            found = _candidates(name, reverse, shapes, renamings)
            if len(found) > 1:
                raise ValueError(f"{file}: tensor {name} matches several {type(hf_config).__name__} weights {found}")
            target = found[0] if found else None
        if target is None:
            unmatched.append(name)
            continue
        out[target] = (tensor,)
    for target, parts in pending.items():
        local_parts = next(p for _, p in rules.merges if set(parts) <= set(p))
        if set(parts) != set(local_parts):
            raise ValueError(f"{file}: {target} needs tensors {local_parts}, the file has {sorted(parts)}")
        out[target] = tuple(parts[p] for p in local_parts)
    if unmatched:
        raise ValueError(f"{file}: tensors with no {type(hf_config).__name__} weight: {unmatched[:10]}")
    return CheckpointTensors(reader, out, rules, hf_config, shapes, file)


def _undo(name: str, value: Value, rules: ArchRules, hf_config: Any, shape: tuple[int, ...], file: str) -> Value:
    """The value transforms of the module docstring, then :func:`fit`."""
    if name.endswith("A_log"):
        a = value.dequantize() if isinstance(value, CodedWeight) else value.float()
        value = torch.log(-a)
    if rules.norm_offset and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = (value.dequantize() if isinstance(value, CodedWeight) else value.float()) - 1
    if rules.tiled_value_heads and ".linear_attn." in name:
        value = _untile_value_heads(name, value, hf_config)
    if name.endswith("linear_attn.in_proj_qkvz.weight"):
        value = _rows(value, _qkvz_rows(hf_config))
    if rules.permute_qk and re.search(r"\.(q_proj|k_proj)\.(weight|bias)$", name):
        heads = hf_config.num_attention_heads if ".q_proj." in name else hf_config.num_key_value_heads
        value = _unpermute(value, heads)
    return fit(name, value, shape, file)
