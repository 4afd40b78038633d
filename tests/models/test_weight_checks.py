"""Checkpoint tensors are checked as they load (``models/weight_checks.py``): a NaN or an infinity, a tensor of
the wrong kind of dtype, and a truncated or corrupt safetensors file are ValueErrors naming the tensor or the
file (before, NaN weights loaded and every answer came back empty, an int tensor was cast, and a truncated
file raised safetensors' own error naming no file)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.cache.spec import CacheDtypes
from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import main
from hybridserve.models import weight_checks
from hybridserve.models.loader import build_model, load_hf_config
from tests.checkpoints import make

TENSOR = "model.layers.0.mamba.in_proj.weight"


def _variant(src: str, dst, mutate) -> str:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    mutate(weights)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _load(path: str):
    hf_config = load_hf_config(path)
    dtypes = EngineConfig(model=path).resolve_dtypes(hf_config)
    return build_model(path, hf_config, dtypes.model, CacheDtypes.from_resolved(dtypes), torch.device("cpu"))


def _poison(value: float, index: int = 7):
    def mutate(weights):
        weights[TENSOR].view(-1)[index] = value
    return mutate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_is_refused_naming_it(ckpt_dir, tmp_path, dtype, value):
    path = _variant(make(ckpt_dir, "bamba", dtype=dtype), tmp_path / "bad", _poison(value, index=7))
    with pytest.raises(ValueError, match=rf"weight '{TENSOR}' in '.*model.safetensors' has 1 NaN or infinite "
                                         rf"value.*flat index 7"):
        _load(path)


def test_healthy_checkpoint_still_loads(ckpt_dir):
    model = _load(make(ckpt_dir, "bamba", dtype=torch.bfloat16))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool], ids=str)
def test_integer_or_bool_tensor_for_a_float_weight_is_refused(ckpt_dir, tmp_path, dtype):
    def mutate(weights):
        weights[TENSOR] = torch.ones_like(weights[TENSOR], dtype=dtype)
    path = _variant(make(ckpt_dir, "bamba"), tmp_path / "int", mutate)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"wrong dtype: {TENSOR}: {name}, expected a floating-point dtype"):
        _load(path)


def test_float_tensor_for_integer_codes_is_refused():
    expected = {"codes": torch.empty(4, 4, dtype=torch.int8, device="meta"),
                "scale": torch.empty(4, device="meta")}
    loaded = {"codes": torch.zeros(4, 4), "scale": torch.ones(4)}
    assert weight_checks.wrong_dtype_classes(loaded, expected) == ["codes: float32, expected an integer dtype"]
    loaded["codes"] = torch.zeros(4, 4, dtype=torch.int8)
    assert weight_checks.wrong_dtype_classes(loaded, expected) == []


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_weights_file_is_named(ckpt_dir, tmp_path, damage):
    path = tmp_path / "ckpt"
    shutil.copytree(make(ckpt_dir, "bamba"), path)
    file = path / "model.safetensors"
    if damage == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    else:
        file.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=rf"weights file '{file}' is truncated, corrupt or unreadable"):
        _load(str(path))


def test_missing_shard_is_named(ckpt_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(make(ckpt_dir, "bamba"), path)
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00002.safetensors"}}')
    with pytest.raises(ValueError, match=r"weights file '.*model-00002.safetensors' is truncated, corrupt or "
                                         r"unreadable"):
        _load(str(path))


def test_float16_sum_overflow_is_not_mistaken_for_infinity():
    """A float16 tensor whose sum overflows (every value large) is finite: the exact check decides."""
    tensor = torch.full((4096,), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(tensor.sum())
    weight_checks.check_finite(tensor, "big")  # no error
    tensor[100] = float("inf")
    with pytest.raises(ValueError, match="big has 1 NaN or infinite value.*flat index 100"):
        weight_checks.check_finite(tensor, "big")


@pytest.mark.parametrize("dtype,bad", [(torch.float8_e4m3fn, [0x7F, 0xFF]), (torch.float8_e5m2, [0x7C, 0xFC, 0x7E])],
                         ids=["e4m3fn", "e5m2"])
def test_fp8_non_finite_codes_are_found(dtype, bad, monkeypatch):
    monkeypatch.setattr(weight_checks, "FP8_CHUNK", 64)  # several chunks
    every_finite = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    every_finite = every_finite[torch.isfinite(every_finite.view(dtype).to(torch.float32))]
    tensor = every_finite.repeat(3).view(dtype)  # every finite code, the largest included
    weight_checks.check_finite(tensor, "codes")
    for code in bad:
        poisoned = tensor.clone()
        poisoned.view(torch.uint8)[200] = code
        with pytest.raises(ValueError, match="codes has 1 NaN or infinite value.*flat index 200"):
            weight_checks.check_finite(poisoned, "codes")


def test_cli_reports_nan_weights_as_one_line(ckpt_dir, tmp_path, capsys):
    path = _variant(make(ckpt_dir, "bamba"), tmp_path / "bad", _poison(float("nan")))
    assert main(["generate", "hello", "--model", path, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: weight ") and TENSOR in err[-1] and "Traceback" not in "\n".join(err)
