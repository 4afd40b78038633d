"""Building and loading the compiled kernels (``hybridserve.kernels.build``): no compiler, a failing
build or missing sources mean no library (the PyTorch paths run), never an exception; a built library
is cached on disk under its content hash and reused without recompiling.

Every test works on fresh memo dicts and a temporary cache dir (monkeypatched: restored afterwards)."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.kernels import _abi, build, enable_cpu_kernels, isa, pointwise
from hybridserve.layers.norms import RMSNorm
from hybridserve.ops.dispatch import runs_on_kernels, use_kernels

OK_SOURCE = '#include "isa_level.h"\nextern "C" int hs_answer(void) { return 42; }\n'


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty memo dicts (build._loaded, _abi._bound) and an empty kernel cache dir; returns the cache dir."""
    cache = tmp_path / "kernel-cache"
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(_abi, "_bound", {})
    return cache


@pytest.fixture
def sources(monkeypatch, tmp_path):
    """A temporary source dir in place of csrc/, with a tiny valid ``ok.cpp`` and an invalid ``bad.cpp``."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "ok.cpp").write_text(OK_SOURCE)
    (src / "isa_level.h").write_text((build.SOURCE_DIR / "isa_level.h").read_text())
    (src / "bad.cpp").write_text("this is not C++ {\n")
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    return src


needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(tmp_path / "x"))
    assert build.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("HYBRIDSERVE_KERNEL_CACHE")
    assert build.cache_dir().parts[-3:] == (".cache", "hybridserve", "kernels")


def test_no_compiler_means_no_library(fresh, monkeypatch, caplog):
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        assert build.load_library("pointwise") is None
    assert "no C++ compiler" in caplog.text
    assert build._loaded == {("pointwise", isa.level_in_force()): None}  # remembered: not retried on every call
    assert not fresh.exists() or not any(fresh.iterdir())  # nothing was built
    # the entry points decline, and the layers keep working on their PyTorch paths
    assert pointwise.available() is False
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    assert pointwise.rms_norm(x, w, 1e-6) is None
    assert pointwise.silu_mul(x, x) is None
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(w)
    expected = norm(x)
    with use_kernels(True):
        assert torch.equal(norm(x), expected)


def test_no_compiler_leaves_the_model_on_pytorch_paths(fresh, monkeypatch):
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    model = torch.nn.Sequential(RMSNorm(8), RMSNorm(8))
    assert enable_cpu_kernels(model) is False
    assert not runs_on_kernels(model)


@needs_compiler
def test_failed_build_means_no_library(fresh, sources, caplog):
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        assert build.load_library("bad") is None
    assert "bad unavailable" in caplog.text and "failed" in caplog.text  # the compiler's error is logged
    assert not fresh.exists() or not list(fresh.iterdir())  # no half-written library left behind


@pytest.mark.parametrize("compiler", ["/bin/false", "/nonexistent/dir/g++"], ids=["fails", "missing"])
def test_broken_compiler_means_no_library(fresh, sources, monkeypatch, caplog, compiler):
    monkeypatch.setattr(build, "find_compiler", lambda: compiler)
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        assert build.load_library("ok") is None
    assert "ok unavailable" in caplog.text
    assert not fresh.exists() or not list(fresh.iterdir())


def test_missing_sources_mean_no_library(fresh, sources):
    """An install without the C++ sources (say, a wheel that does not ship csrc/) falls back too."""
    assert build.load_library("recurrent") is None


@needs_compiler
def test_library_is_cached_and_reused(fresh, sources, monkeypatch):
    compiled = []
    real_compile = build._compile

    def counting_compile(compiler, flags, srcs, target):
        compiled.append(target)
        real_compile(compiler, flags, srcs, target)

    monkeypatch.setattr(build, "_compile", counting_compile)
    lib = build.load_library("ok")
    assert lib is not None and lib.hs_answer() == 42
    assert len(compiled) == 1 and compiled[0].parent == fresh and compiled[0].exists()
    # only the library and its build record (no temp files)
    assert sorted(p.name for p in fresh.iterdir()) == [compiled[0].name, compiled[0].name + ".sha256"]
    assert build.load_library("ok") is lib  # memoized in the process

    # A new process (fresh memo) finds the library on disk: no compiler run.
    def no_compile(*args):
        raise AssertionError("recompiled although the cached library is current")

    monkeypatch.setattr(build, "_compile", no_compile)
    monkeypatch.setattr(build, "_loaded", {})
    lib2 = build.load_library("ok")
    assert lib2 is not None and lib2.hs_answer() == 42

    # Changed sources (or a new header) get a new library: the cache key covers them.
    (sources / "ok.cpp").write_text(OK_SOURCE.replace("42", "43"))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_compile", counting_compile)
    lib3 = build.load_library("ok")
    assert lib3 is not None and lib3.hs_answer() == 43 and len(compiled) == 2 and compiled[1] != compiled[0]
    (sources / "extra.h").write_text("// a header\n")
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load_library("ok") is not None and len(compiled) == 3 and compiled[2] not in compiled[:2]


@needs_compiler
def test_real_kernels_bind_once(monkeypatch):
    """The project's libraries load (from the real kernel cache, as the other kernel tests use it) and
    bind their entry points, once per process."""
    from hybridserve.kernels import attention, recurrent

    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(_abi, "_bound", {})
    for module, fns in ((pointwise, ("hs_rms_norm", "hs_gated_rms_norm", "hs_silu_mul")),
                        (attention, ("hs_kv_write", "hs_paged_attention")),
                        (recurrent, ("hs_causal_conv1d", "hs_mamba2_scan"))):
        assert module.available() is True
        lib = module._library()
        assert module._library() is lib  # memoized
        assert str(build.cache_dir()) in lib.cdll._name  # the cached library file
        for fn in fns:
            kernel = getattr(lib, fn)
            assert isinstance(kernel, _abi.Kernel) and kernel.signature and set(kernel.signature) <= set(_abi.CTYPES)
    assert sorted(name for name, _ in build._loaded) == ["attention", "pointwise", "recurrent"]
