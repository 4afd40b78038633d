"""Load a checkpoint directory in the HF layout: config.json, safetensors weights, tokenizer."""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

import torch
from torch import nn

from hybridserve.cache.spec import CacheDtypes
from hybridserve.models import fp8_checkpoint, weight_checks
from hybridserve.models.base import CausalLM
from hybridserve.models.gguf.coded import CodedWeight
from hybridserve.models.gguf.load import install_coded
from hybridserve.models.registry import SERVED_AS_TEXT, architecture_of, model_class


def load_hf_config(path: str, check_memory: bool = True) -> Any:
    """config.json through transformers' AutoConfig (older key names are converted there), after its values
    are checked (``models/config_checks.py``; with ``check_memory``, that the weights fit in this machine's
    memory: off for planning a model for another machine); a value transformers still rejects is a
    ValueError naming the file."""
    from transformers import AutoConfig

    from hybridserve.models import config_checks
    from hybridserve.models.config_file import read_config_values
    from hybridserve.models.gguf.reader import gguf_file

    file = gguf_file(path)
    if file is not None:  # a GGUF checkpoint: its config from the file's metadata (models/gguf/)
        from hybridserve.models.gguf.load import gguf_config

        return gguf_config(file)
    if not os.path.isdir(path):
        raise ValueError(f"model={path!r} is not a directory holding a checkpoint")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model={path!r} has no config.json")
    config_checks.check_config_values(read_config_values(path), file, check_memory)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # any failure of the config class on this file (its validators raise their own types)
        message = " ".join(str(exc).split())  # one line
        raise ValueError(f"{file}: transformers rejects this config ({type(exc).__name__}: {message})") from exc
    return served_text_config(config)


def served_text_config(config: Any) -> Any:
    """For a vision-language architecture served as text (``registry.SERVED_AS_TEXT``): a copy of its
    ``text_config`` naming the checkpoint's architecture, with the top-level ``tie_word_embeddings`` and
    ``dtype`` (HF's for the whole model). Any other config unchanged."""
    archs = getattr(config, "architectures", None) or []
    text = getattr(config, "text_config", None)
    if text is None or not archs or archs[0] not in SERVED_AS_TEXT:
        return config
    text = copy.copy(text)
    text.architectures = list(archs)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    return text


def checkpoint_tensors(path: str, renames, skip: str | None, hf_config: Any = None):
    """``(open safetensors file, raw name, renamed name)`` of every checkpoint tensor whose raw name ``skip``
    (a regex, or None) does not match, file by file: read a tensor with ``f.get_tensor(raw)``, which refuses
    one holding a NaN or an infinity (``models/weight_checks.py``: a ValueError naming it and its file). A GGUF
    checkpoint (``models/gguf/``) gives its tensors under the checkpoint names of ``hf_config``'s model, some as
    ``CodedWeight`` (quantized linear weights)."""
    from hybridserve.models.gguf.reader import gguf_file

    file = gguf_file(path)
    if file is not None:
        from hybridserve.models.gguf.load import gguf_checkpoint_tensors

        yield from gguf_checkpoint_tensors(file, hf_config, renames, skip)
        return
    for f in weight_checks.open_checked(weight_files(path)):
        for raw in f.keys():
            if skip is None or not re.match(skip, raw):
                yield f, raw, _rename(raw, renames)


def weight_files(path: str) -> list[str]:
    """The checkpoint's safetensors files (sharded through its index when there is one)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    return [os.path.join(path, f) for f in files]


def float32_parameters(hf_config: Any, dtype: torch.dtype, names) -> list[str]:
    """The parameter ``names`` HF's model class keeps in float32 in a ``dtype`` model, by its own attributes:
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16, ``_keep_in_fp32_modules`` for float16 alone
    (as ``PreTrainedModel._get_dtype_plan``). A pattern names a module or parameter path (``gate.weight``)
    and matches whole dotted components of a name."""
    if dtype not in (torch.float16, torch.bfloat16):
        return []
    hf_class = _hf_class(hf_config)
    patterns = set(getattr(hf_class, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        patterns |= set(getattr(hf_class, "_keep_in_fp32_modules", None) or [])
    if not patterns:
        return []
    regex = re.compile(r"(^|\.)(" + "|".join(re.escape(p) for p in sorted(patterns)) + r")($|\.)")
    return [name for name in names if regex.search(name)]


def _hf_class(hf_config: Any) -> type | None:
    """transformers' causal-LM class for ``hf_config`` (None when it has none)."""
    import transformers

    cls = getattr(transformers, architecture_of(hf_config), None)
    if cls is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config))
    return cls


def _rename(name: str, renames: list[tuple[str, str]]) -> str:
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def load_weights(model: CausalLM, path: str, dtype: torch.dtype, device: torch.device, keep_fp8: bool = False) -> None:
    """Load every parameter strictly: missing, unexpected and mis-shaped weights, weights with a NaN or an
    infinity, and weights of the wrong kind of dtype (an int or bool tensor for a float parameter) are
    errors naming them.

    An fp8 checkpoint's weights (``models/fp8_checkpoint.py``) are dequantized to ``dtype``, except, with
    ``keep_fp8``, those of plain ``nn.Linear`` layers: these keep their e4m3 codes, with ``weight_scale``
    (N, G) float32 and ``weight_group`` on the layer, for the 8-bit CPU kernel."""
    renames = getattr(model, "checkpoint_renames", [])
    skip = getattr(model, "checkpoint_skip", None)  # a regex of raw names never read (a vision tower, say)
    # optional model hook: {renamed name: tensor} -> {model name: tensor} (e.g. stack per-expert weights)
    transform = getattr(model, "transform_checkpoint", None)
    expected = dict(model.named_parameters())
    tied = set(model.tied_weights) if getattr(model.hf_config, "tie_word_embeddings", False) else set()
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    kv_scales: list[tuple[nn.Module, tuple[str, ...], torch.Tensor]] = []
    qc = fp8_checkpoint.fp8_config(model.hf_config)
    fp8_scales: dict[str, torch.Tensor] = {}
    coded: dict[str, tuple[int, ...]] = {}  # a GGUF file's quantized linear weights (installed as read): shapes
    keep_fp32 = set(float32_parameters(model.hf_config, dtype, expected))
    for f, raw, name in checkpoint_tensors(path, renames, skip, model.hf_config):
        target = kv_scale_target(model, name)
        if target is not None:  # an fp8 KV scale: an attribute of its attention layer, not a weight
            kv_scales.append((*target, f.get_tensor(raw)))
            continue
        if qc is not None and fp8_checkpoint.is_scale(name):
            fp8_scales[name] = f.get_tensor(raw)
            continue
        if name not in expected and transform is None:
            unexpected.append(raw)
            continue
        tensor = f.get_tensor(raw)
        if isinstance(tensor, CodedWeight):
            if name in expected and _is_plain_linear_weight(model, name):
                coded[name] = tuple(tensor.shape)
                if coded[name] == tuple(expected[name].shape):  # else refused below, with every other bad shape
                    _install_coded(model, name, tensor, device)  # now: no converted weight waits in memory
                continue
            for head in _coded_tied_heads(model, name, tensor, tied):  # a tied Q6_K LM head: its own 6-bit copy
                _install_coded(model, head, tensor, device)
            # an embedding, an expert block, a layer that reads its own weight: in the dtype assigned below
            tensor = tensor.dequantize(dtype if name in expected and name not in keep_fp32 else torch.float32)
        elif qc is None and name in expected and name not in keep_fp32 and tensor.is_floating_point():
            tensor = tensor.to(dtype)  # as assigned below; a float32 copy of a 16-bit model's weight is not kept
        loaded[name] = tensor
    fp8 = {} if qc is None else fp8_checkpoint.split_fp8(
        loaded, fp8_scales, qc, lambda n: keep_fp8 and n in expected and _is_plain_linear_weight(model, n))
    if transform is not None:
        loaded = transform(loaded)
        unexpected = [n for n in loaded if n not in expected]
        loaded = {n: t for n, t in loaded.items() if n in expected}
    slicers = getattr(model, "tp_slicers", None)  # tensor parallelism: each rank's slice (distributed/sharding.py)
    if slicers and coded:
        raise ValueError(f"checkpoint {path!r} has quantized GGUF weights ({next(iter(coded))}, ...), which "
                         "tensor parallelism does not split: use --tensor-parallel-size 1 or a BF16/F32 GGUF file")
    if slicers:
        loaded = {n: slicers[n](t) if n in slicers else t for n, t in loaded.items()}
    missing = [n for n in expected if n not in loaded and n not in tied and n not in coded]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match {type(model).__name__}: "
                         f"missing weights {missing[:20]}{'...' if len(missing) > 20 else ''}; "
                         f"unexpected weights {unexpected[:20]}{'...' if len(unexpected) > 20 else ''}")
    shapes = {**{n: tuple(t.shape) for n, t in loaded.items()}, **coded}
    bad = [f"{n}: checkpoint {shape} vs model {tuple(expected[n].shape)}"
           for n, shape in shapes.items() if shape != tuple(expected[n].shape)]
    if bad:
        raise ValueError(f"checkpoint {path!r} has weights of the wrong shape: " + "; ".join(bad[:20]))
    bad = weight_checks.wrong_dtype_classes(loaded, expected)
    if bad:
        raise ValueError(f"checkpoint {path!r} has weights of the wrong dtype: " + "; ".join(bad[:20]))
    materialize_meta(model, device)  # the coded linears installed above are not allocated again
    with torch.no_grad():
        for name, tensor in loaded.items():
            if name in fp8:
                continue
            target = expected[name]
            target_dtype = dtype if target.is_floating_point() else target.dtype
            owner, attr = _owner(model, name)
            getattr(owner, attr).data = tensor.to(device=device, dtype=target_dtype)
    model.to(dtype=dtype)
    for name in float32_parameters(model.hf_config, dtype, [n for n in expected if n in loaded]):  # HF keeps in fp32
        owner, attr = _owner(model, name)
        getattr(owner, attr).data = loaded[name].to(device=device, dtype=torch.float32)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    for name, (codes, scales, group) in fp8.items():
        owner, attr = _owner(model, name)
        getattr(owner, attr).data = codes.to(device)
        owner.weight_scale, owner.weight_group = scales.to(device), group
    model.tie_weights_if_needed()
    for module, attrs, tensor in kv_scales:
        for attr in attrs:
            setattr(module, attr, float(tensor.float().max()))  # per-tensor; the largest of per-head scales


#: checkpoint names of fp8 KV-cache scales, relative to the attention module: (pattern, attributes set)
KV_SCALE_NAMES: tuple[tuple[re.Pattern, tuple[str, ...]], ...] = (
    (re.compile(r"^(?P<attn>.+)\.k_proj\.(?:k_scale|output_scale)$"), ("k_scale",)),  # ModelOpt; older
    (re.compile(r"^(?P<attn>.+)\.v_proj\.(?:v_scale|output_scale)$"), ("v_scale",)),  # compressed-tensors
    (re.compile(r"^(?P<attn>.+)\.k_scale$"), ("k_scale",)),  # compressed-tensors, vLLM
    (re.compile(r"^(?P<attn>.+)\.v_scale$"), ("v_scale",)),
    (re.compile(r"^(?P<attn>.+)\.kv_scale$"), ("k_scale", "v_scale")),  # deprecated: one scale for both
)


def kv_scale_target(model: nn.Module, name: str) -> tuple[nn.Module, tuple[str, ...]] | None:
    """The attention module and scale attributes a checkpoint tensor ``name`` sets, if it is a KV scale.

    Accepted names, for an attention module at ``model.layers.3.self_attn``: ``...self_attn.k_scale``
    / ``v_scale``, ``...self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, ``...self_attn.k_proj.output_scale``
    / ``v_proj.output_scale``, ``...self_attn.kv_scale`` (both), and the same under ``...self_attn.attn``.
    """
    for pattern, attrs in KV_SCALE_NAMES:
        match = pattern.match(name)
        if match is None:
            continue
        prefix = match.group("attn")
        for candidate in (prefix, prefix.removesuffix(".attn")):
            try:
                module = model.get_submodule(candidate)
            except AttributeError:
                continue
            spec = getattr(module, "spec", None)
            if getattr(spec, "attention", None) is not None:
                return module, attrs
        return None
    return None


def _install_coded(model: nn.Module, name: str, weight: CodedWeight, device: torch.device) -> None:
    """Install the coded weight ``name`` into its ``nn.Linear`` (``gguf.load.install_coded``) before the model's
    other tensors are allocated: its layer's bias, still on the meta device, is allocated with them."""
    owner, attr = _owner(model, name)
    parent, child = _owner(model, name.rsplit(".", 1)[0])
    install_coded(owner, attr, parent, child, weight, device)


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` for the parameters and buffers still on the meta device only (those
    already holding values, a coded weight installed at load, are kept); a tensor shared by several modules gets
    one allocation."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in made:
                    empty = torch.empty_like(tensor, device=device)
                    made[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else empty)
                table[key] = made[id(tensor)]


def _coded_tied_heads(model: nn.Module, name: str, weight: CodedWeight, tied: set[str]) -> list[str]:
    """The tied weights (an LM head tied to the embedding ``name``) that take their own copy of ``weight``, a
    GGUF file's Q6_K embedding: plain linears of its shape, run 6-bit (``layers/linear_w6k.py``) instead of on the
    embedding dequantized (``CausalLM.tie_weights_if_needed`` then leaves them)."""
    if weight.bits != 6:
        return []
    heads = []
    for dst in sorted(tied):
        if model.tied_weights.get(dst) == name and _is_plain_linear_weight(model, dst):
            owner, attr = _owner(model, dst)
            if tuple(getattr(owner, attr).shape) == tuple(weight.shape):
                heads.append(dst)
    return heads


def _is_plain_linear_weight(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the weight of an ``nn.Linear`` the CPU kernels pack (not a ``prepack = False`` one)."""
    owner, attr = _owner(model, name)
    return type(owner) is nn.Linear and attr == "weight" and getattr(owner, "prepack", True)


def _owner(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, attr = dotted.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    return mod, attr


def build_model(path: str, hf_config: Any, dtype: torch.dtype, dtypes: CacheDtypes,
                device: torch.device, keep_fp8: bool = False, tp_group: Any = None) -> CausalLM:
    """Construct the model on the meta device, then load its weights in ``dtype`` on ``device`` (an fp8
    checkpoint's linears as e4m3 codes with ``keep_fp8``, else dequantized). With ``tp_group`` (a
    ``distributed.group.TPGroup`` of several ranks), the model is this rank's shard."""
    architecture = architecture_of(hf_config)
    cls = model_class(architecture)
    try:
        with torch.device("meta"):
            model = cls(hf_config, dtypes)
    except (ArithmeticError, TypeError, IndexError, KeyError, AttributeError) as exc:  # a config value out of range
        raise ValueError(f"config.json of {path!r} does not describe a buildable {architecture}: "
                         f"{type(exc).__name__}: {exc}") from exc
    if tp_group is not None and tp_group.world > 1:
        from hybridserve.distributed.sharding import shard_model

        shard_model(model, architecture, tp_group)
    load_weights(model, path, dtype, device, keep_fp8)
    model.eval()
    model.requires_grad_(False)
    return model
