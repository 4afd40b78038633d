"""CPU feature detection, the ISA levels and their cap (``hybridserve.kernels.isa``), and libraries
built and cached per level (``kernels/build.py``): a library built for another feature set than the
one asked for, or for one this CPU lacks, is never loaded."""

from __future__ import annotations

import shutil

import pytest

from hybridserve.kernels import _abi, build, isa, library_record

OK_SOURCE = ('#include "isa_level.h"\n#include "registry.h"\nextern "C" int hs_answer(void) { return 7; }\n'
             'HS_REGISTRY(HS_KERNEL(hs_answer))\n')
needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
BF16 = {"avx512_bf16", "avx512_vnni"}  # the avx512_bf16 level's features on top of AVX512


def cpu(features, arch="x86_64"):
    return isa.CpuInfo(arch=arch, model="test", features=frozenset(features))


@pytest.mark.parametrize("features,best", [
    (set(), "generic"),
    ({"avx2", "fma"}, "generic"),  # no F16C: not the avx2 level
    (AVX2, "avx2"),
    (AVX2 | {"avx512f"}, "avx2"),  # AVX-512 F alone is not the avx512 level
    (AVX512, "avx512"),
    (AVX512 | BF16, "avx512_bf16"),
    (AVX512 | {"avx512_bf16"}, "avx512"),  # AVX-512 BF16 without VNNI (W8A8's vpdpbusd): not the level
    (AVX512 | {"avx512_vnni"}, "avx512"),  # VNNI alone (Cascade Lake, Ice Lake)
    (AVX512 | BF16 | {"amx_bf16"}, "avx512_bf16"),  # AMX-BF16 without AMX-TILE
    (AVX512 | BF16 | {"amx_tile", "amx_bf16"}, "amx"),
    (AVX512 | {"amx_tile", "amx_bf16"}, "avx512"),  # AMX without AVX-512 BF16: the levels are nested
    (AVX2 | {"avx512_bf16"}, "avx2"),  # BF16 without the AVX-512 base
])
def test_best_level_of_a_feature_set(features, best):
    assert cpu(features).best_level == best
    assert cpu(features).supports("generic")


def test_amx_needs_the_tile_data_permission():
    refused = isa.CpuInfo(arch="x86_64", model="test", features=frozenset(AVX512 | BF16 | {"amx_tile", "amx_bf16"}),
                          amx_granted=False)
    assert refused.best_level == "avx512_bf16"
    assert any("permission" in m for m in refused.missing("amx"))


def test_this_process_has_the_amx_permission_where_the_cpu_has_amx():
    info = isa.cpu_info()
    if "amx_tile" not in info.features:
        pytest.skip("this CPU has no AMX (amx_tile)")
    assert info.amx_granted and isa.amx_permission()  # Linux grants XTILEDATA to a process that asks


def test_non_x86_cpus_run_the_generic_level_only():
    arm = cpu(AVX512 | {"avx512_bf16"}, arch="aarch64")  # flags of another ISA mean nothing there
    assert arm.best_level == "generic" and not arm.supports("avx2")


def test_compiler_flags_are_explicit_per_level():
    assert isa.compiler_flags("generic") == []  # a non-x86 compiler takes a generic build
    avx2, avx512, bf16, amx = (isa.compiler_flags(lv) for lv in ("avx2", "avx512", "avx512_bf16", "amx"))
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(avx2) and not any("avx512" in f for f in avx2)
    assert set(avx2) < set(avx512) < set(bf16) < set(amx) and "-mavx512bf16" in bf16 and "-mavx512bf16" not in avx512
    assert "-mavx512vnni" in bf16 and "-mavx512vnni" not in avx512
    assert {"-mamx-tile", "-mamx-bf16"} <= set(amx) and not any("amx" in f for f in bf16)
    for level in isa.LEVELS:
        assert not any(f.startswith("-march") for f in build.flags("pointwise", level))  # never -march=native


def test_unknown_levels_are_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match="allowed values: generic, avx2, avx512, avx512_bf16, amx"):
        isa.set_cap("sse9")
    from hybridserve.config import EngineConfig

    with pytest.raises(ValueError, match=r"cpu_isa='avx3'.*auto, generic, avx2"):
        EngineConfig(model="x", cpu_isa="avx3")
    assert EngineConfig(model="x", cpu_isa="AVX2").cpu_isa == "avx2"


def test_cap_lowers_the_level_in_force_and_never_raises_it():
    previous = isa.cap()
    best = isa.cpu_info().best_level
    try:
        assert isa.set_cap("generic") == "generic"
        assert isa.set_cap("amx") == best  # a cap above the CPU changes nothing
        assert isa.set_cap("auto") == best
    finally:
        isa.set_cap(previous)


def test_cap_torch_sets_onednn_and_aten_caps(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    isa.cap_torch("auto")
    import os

    assert "ONEDNN_MAX_CPU_ISA" not in os.environ
    isa.cap_torch("avx2")
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"


def test_this_cpu_is_detected():
    info = isa.cpu_info()
    assert info.best_level in isa.LEVELS and info.supports(info.best_level)
    assert isa.runnable_levels()[0] == "generic" and isa.runnable_levels()[-1] == info.best_level
    if info.is_x86:
        import torch

        assert ("avx2" in info.features) == torch.cpu._is_avx2_supported()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty memo dicts, an empty kernel cache dir and a source dir with ``ok.cpp``; returns the cache."""
    cache = tmp_path / "kernel-cache"
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "ok.cpp").write_text(OK_SOURCE)
    for header in ("isa_level.h", "registry.h", "kernels.h"):
        (src / header).write_text((build.SOURCE_DIR / header).read_text())
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failures", {})
    monkeypatch.setattr(_abi, "_bound", {})
    return cache


@needs_compiler
def test_each_level_has_its_own_cached_library_reporting_its_level(fresh):
    compiler = build.find_compiler()
    paths = {lv: build.library_path("ok", lv, compiler) for lv in isa.LEVELS}
    assert len(set(paths.values())) == len(isa.LEVELS)  # the level is part of the key
    assert all(f"ok-{lv}-" in paths[lv].name for lv in isa.LEVELS)
    for level in isa.runnable_levels():
        lib = build.load_library("ok", level)
        assert lib is not None and lib.hs_answer() == 7
        assert lib.hs_built_isa_level() == isa.LEVELS.index(level)  # the compiler applied that level's flags
        assert lib._name == str(paths[level])


@needs_compiler
def test_a_library_built_for_another_feature_set_is_not_loaded(fresh):
    """A cache shared between hosts holds a library built for other features under this host's key
    (a copied file with its build record, say): its own report of the level it was built for refuses it."""
    compiler = build.find_compiler()
    built_for_avx2 = build.build_library("ok", "avx2")  # building needs no CPU support
    wrong = build.library_path("ok", "generic", compiler)
    shutil.copy(built_for_avx2, wrong)
    shutil.copy(library_record.record_path(built_for_avx2), library_record.record_path(wrong))
    assert build.load_library("ok", "generic") is None
    assert "built for level 1, not generic" in build.unavailable_reason("ok", "generic")


@needs_compiler
def test_a_level_this_cpu_lacks_is_never_loaded(fresh):
    missing = [lv for lv in isa.LEVELS if not isa.cpu_info().supports(lv)]
    if not missing:
        pytest.skip(f"this CPU runs every level ({isa.cpu_info().best_level})")
    level = missing[-1]
    target = build.build_library("ok", level)  # e.g. AVX-512 BF16 code, compiled here but never run
    assert target.exists()
    assert build.load_library("ok", level) is None
    assert "cannot run code built for" in build.unavailable_reason("ok", level)


@needs_compiler
def test_bind_follows_the_level_in_force(fresh):
    previous = isa.cap()
    try:
        libs = {}
        for level in isa.runnable_levels():
            isa.set_cap(level)
            libs[level] = _abi.bind("ok")
            assert libs[level].hs_answer() == 7  # bound from the library's registry
            assert libs[level].cdll.hs_built_isa_level() == isa.LEVELS.index(level)
        assert len({id(lib) for lib in libs.values()}) == len(libs)
    finally:
        isa.set_cap(previous)


@needs_compiler
@pytest.mark.skipif(not isa.cpu_info().is_x86, reason="the x86 levels build only for x86")
def test_every_level_of_every_library_compiles(monkeypatch, tmp_path):
    """The variants this CPU cannot run still compile (they are tested where they run): an edit that
    breaks the AVX-512 code is caught on an AVX2 machine too. Levels this CPU runs are built and tested
    by the kernel tests."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridserve.kernels import LIBRARIES

    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(tmp_path))
    levels = [lv for lv in isa.LEVELS if not isa.cpu_info().supports(lv)]
    if not levels:
        pytest.skip("this CPU runs every level: the kernel tests build and run them all")
    jobs = [(name, lv) for name in LIBRARIES + ["probe"] for lv in levels]
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = list(pool.map(lambda job: build.build_library(*job), jobs))
    assert all(path.exists() and path.stat().st_size > 0 for path in built)


@needs_compiler
@pytest.mark.skipif(isa.cpu_info().supports("avx512"), reason="this CPU runs the 16-lane builds themselves")
@pytest.mark.parametrize("width", [16])
def test_the_16_lane_vector_code_gives_the_8_lane_bits(monkeypatch, tmp_path, width):
    """The AVX-512 builds' float32 vector code (16-lane linear tiles of 16-bit and float32 weights,
    16-lane scan and attention loops) does the same lane arithmetic as the AVX2 builds' 8-lane code:
    built here at the avx2 level with 16-lane vectors (slow, spilled, but the same operations), every
    output equals the 8-lane build's bit for bit. So the code that only AVX-512 CPUs run is checked on this one too."""
    import torch

    from hybridserve.kernels import gemm, recurrent
    from tests.kernels.helpers import assert_bits_equal
    from tests.kernels.test_attention_kernels import AttnCase

    if isa.level_in_force() != "avx2":
        pytest.skip(f"compares against the avx2 build; the level in force is {isa.level_in_force()}")
    g = torch.Generator().manual_seed(0)

    def run_all():
        out = {}
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for M, N, K in ((1, 70, 96), (13, 50, 333), (37, 40, 64)):
                x = torch.randn(M, K, generator=g).to(dtype)
                w = torch.randn(N, K, generator=g).to(dtype)
                b = torch.randn(N, generator=g).to(dtype)
                out[f"linear {dtype} {M}x{N}x{K}"] = gemm.linear(x, gemm.pack(w), N, b)
        T, H, P, N = 40, 4, 64, 16
        states = torch.randn(3, H, P, N, generator=g)
        xs, dt = torch.randn(T, H * P, generator=g), torch.randn(T, H, generator=g)
        B, C = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
        y = torch.empty(T, H * P)
        assert recurrent.mamba2_scan(states, xs, dt, -torch.rand(H, generator=g), B, C, torch.rand(H, generator=g),
                                     torch.rand(H, generator=g), True, (0.0, float("inf")),
                                     torch.tensor([0, 25, 40]), torch.tensor([2, 0]), y)
        out["scan y"], out["scan state"] = y, states
        for cache_dtype in (torch.bfloat16, torch.float32):  # decode rows and prefill chunks together
            case = AttnCase(torch.bfloat16, cache_dtype, rep=2, q_lens=[1, 9, 1, 20], seq_lens=[37, 20, 70, 33], bs=8,
                            Dh=64, seed=3)
            assert case.run()
            out[f"attention {cache_dtype}"] = case.out.clone()
        return out

    g.manual_seed(0)
    eight = run_all()
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(tmp_path))
    for name in ("gemm", "recurrent", "attention"):
        monkeypatch.setitem(build.EXTRA_FLAGS, name, build.EXTRA_FLAGS.get(name, []) + [f"-DHS_VECTOR_LANES={width}"])
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(_abi, "_bound", {})
    g.manual_seed(0)
    sixteen = run_all()
    for key in eight:
        assert_bits_equal(sixteen[key], eight[key], key)
