"""A quantized GGUF file loads one tensor at a time (models/gguf/tensors.py, models/loader.py): each coded weight
is read, converted and installed in its layer before the next is read, and no 16-bit or float32 weight is
allocated for a linear that stays coded. (Before, every converted tensor of the file was held at once and a
float weight was allocated for every linear, then replaced: a 0.8 GB Q4_K_M file peaked at 6.3 GB of RSS.)"""

import pytest
import torch

gguf = pytest.importorskip("gguf")

from hybridserve.cache.spec import CacheDtypes  # noqa: E402
from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.models import loader  # noqa: E402
from hybridserve.models.gguf import blocks  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.gguf.gguf_writer import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory):
    """A llama checkpoint whose linears have 256 in-features (one k-quant super-block)."""
    path = str(tmp_path_factory.mktemp("gguf") / "llama-256")
    checkpoints.build(checkpoints.llama_config(hidden_size=256), path, std=0.03, dtype=torch.bfloat16)
    return path


def _build(file: str, dtype: str = "auto"):
    hf_config = loader.load_hf_config(file)
    dtypes = EngineConfig(model=file, dtype=dtype).resolve_dtypes(hf_config)
    return loader.build_model(file, hf_config, dtypes.model, CacheDtypes.from_resolved(dtypes), torch.device("cpu"))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_each_coded_weight_is_installed_before_the_next_is_read(tmp_path, llama_256, monkeypatch, kind):
    """Count the block tensors decoded and not yet installed: never more than one (llama has no merged
    projections; the old loader decoded all of them, then installed them)."""
    file = write_gguf(llama_256, str(tmp_path / f"model-{kind}.gguf"), kind)
    waiting, most, installs = [0], [0], [0]
    decode = blocks.DECODERS[kind]

    def counted_decode(raw):
        waiting[0] += 1
        most[0] = max(most[0], waiting[0])
        return decode(raw)

    install = loader.install_coded

    def counted_install(*args, **kwargs):
        waiting[0] = 0
        installs[0] += 1
        return install(*args, **kwargs)

    monkeypatch.setitem(blocks.DECODERS, kind, counted_decode)
    monkeypatch.setattr(loader, "install_coded", counted_install)
    _build(file)
    assert installs[0] >= 3 * 6 + 1  # q, k, v, o, gate, up of 3 layers (down too in Q8_0) and the LM head
    assert most[0] == 1


@pytest.mark.parametrize("kind,dtype", [("Q8_0", "bfloat16"), ("Q4_K", "float32")])
def test_no_float_weight_is_allocated_for_a_coded_linear(tmp_path, llama_256, monkeypatch, kind, dtype):
    """The floating-point elements the loader allocates (``torch.empty_like``, as ``Module.to_empty`` does) are
    at most those of the float tensors the loaded model holds: embeddings and norms, not the coded linears."""
    file = write_gguf(llama_256, str(tmp_path / f"model-{kind}.gguf"), kind)
    allocated = [0]
    empty_like = torch.empty_like

    def counted_empty_like(tensor, *args, **kwargs):
        out = empty_like(tensor, *args, **kwargs)
        if out.is_floating_point():
            allocated[0] += out.numel()
        return out

    monkeypatch.setattr(torch, "empty_like", counted_empty_like)
    model = _build(file, dtype)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}
    held = sum(t.numel() for t in unique.values())
    coded = [m for m in model.modules() if getattr(m, "weight_group", None) or hasattr(m, "packed_weight")]
    assert len(coded) >= 3 * 6 + 1
    assert 0 < allocated[0] <= held


@pytest.mark.parametrize("name", sorted(blocks.FORMATS))
def test_block_tensors_decode_a_slice_of_rows_at_a_time(monkeypatch, name):
    """Decoding in slices of rows (a few per slice here, 8 MiB on real files) gives the whole decode's codes,
    scales and mins exactly, for a 2-D weight and stacked experts (3-D)."""
    from hybridserve.models.gguf import reader
    from tests.gguf.test_blocks import random_blocks

    raw = random_blocks(name, rows=23, cols=512)
    monkeypatch.setattr(reader, "DECODE_BYTES", 3 * raw.shape[1])  # 3 rows a slice: 8 slices, the last of 2
    for data in (raw, raw[:22].reshape(2, 11, -1)):
        whole, sliced = blocks.DECODERS[name](data), reader.decode_rows(blocks.DECODERS[name], data)
        assert len(whole) == len(sliced)
        for a, b in zip(whole, sliced):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q4_0"])
def test_dequantized_in_slices_straight_to_the_model_dtype(monkeypatch, name):
    """``CodedWeight.dequantize(dtype)`` a few rows at a time equals the float32 weight rounded once to ``dtype``
    (what the loader assigned before, from a whole float32 copy)."""
    from hybridserve.models.gguf import coded
    from tests.gguf.test_blocks import coded as decoded
    from tests.gguf.test_blocks import random_blocks

    weight = decoded(name, random_blocks(name, rows=21, cols=512))
    whole = weight.dequantize()
    monkeypatch.setattr(coded, "DEQUANTIZE_ELEMENTS", 4 * 512)  # 4 rows a slice
    assert torch.equal(weight.dequantize(), whole)
    for dtype in (torch.bfloat16, torch.float16):
        out = weight.dequantize(dtype)
        assert out.dtype == dtype and torch.equal(out, whole.to(dtype))


def test_packing_frees_each_8bit_checkpoint_weight_as_it_goes(tmp_path, llama_256, monkeypatch):
    """When the engine packs a Q8_0 file's linears for the 8-bit kernel, the codes of those already packed are
    freed before the next is packed (before, every linear's codes stayed until all were packed: the codes and
    their packed copies counted twice at the peak)."""
    from hybridserve.kernels import gemm, linear_w8
    from hybridserve.layers.packed_linear import is_fp8_linear, pack_kernel_linear_layers

    if not gemm.available():
        pytest.skip("the CPU kernels are not built here")
    model = _build(write_gguf(llama_256, str(tmp_path / "model-Q8_0.gguf"), "Q8_0"))
    coded = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and is_fp8_linear(m)]
    assert len(coded) >= 3 * 7 + 1
    alive: list[tuple[int, int]] = []  # (codes still held by every coded linear, those of the one being packed)
    pack = linear_w8.pack

    def watched_pack(codes, *args, **kwargs):
        alive.append((sum(m.weight.numel() for m in coded), codes.numel()))
        return pack(codes, *args, **kwargs)

    monkeypatch.setattr(linear_w8, "pack", watched_pack)
    pack_kernel_linear_layers(model)
    assert len(alive) == len(coded)
    assert alive[-1][0] == alive[-1][1]  # at the last one, every other's codes are gone
    assert all(m.weight.numel() == 0 for m in coded)
