"""A cached kernel library is loaded only when its bytes match the record its build wrote
(``kernels/library_record.py``): a truncated one (SIGBUS when mapped) or one with other bytes is rebuilt,
and a loaded one that lacks a symbol its source declares is declined with a WARNING naming both.

Every test uses a temporary cache dir and source dir, and fresh memo dicts (monkeypatched). A library is
damaged before this process first loads it (``_build`` compiles without loading): a process keeps the file
it loaded mapped, and loads a path only once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridserve.kernels import _abi, build, isa, library_record

# a library big enough that half of it leaves its writable segment unmapped: loading the truncated file
# raises SIGBUS (the data array pushes that segment past the middle of the file)
BIG_SOURCE = ('#include "isa_level.h"\nextern "C" int hs_answer(void) { return 42; }\n'
              'extern "C" const char hs_padding[1 << 20] = {1};\n')
OTHER_SOURCE = '#include "isa_level.h"\nextern "C" int hs_answer(void) { return 43; }\n'
# a source with a registry declaring hs_answer (the real registry.h needs the real kernels: a stand-in here)
REGISTRY_SOURCE = textwrap.dedent("""\
    #include "isa_level.h"
    #define HS_REGISTRY(...)
    #define HS_KERNEL(fn)
    extern "C" int hs_answer(void) { return 42; }
    extern "C" int hs_registry_size(void) { return 0; }
    extern "C" int hs_registry_entry(void) { return 1; }
    HS_REGISTRY(HS_KERNEL(hs_answer))
    """)
NO_ANSWER_SOURCE = REGISTRY_SOURCE.replace("hs_answer(void) { return 42; }", "hs_other(void) { return 0; }")

needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty kernel cache dir, fresh memo dicts and a source dir holding the test sources."""
    cache = tmp_path / "kernel-cache"
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_failures", {})
    monkeypatch.setattr(_abi, "_bound", {})
    src = tmp_path / "csrc"
    src.mkdir()
    shutil.copy(build.SOURCE_DIR / "isa_level.h", src)
    for name, text in (("big", BIG_SOURCE), ("other", OTHER_SOURCE), ("reg", REGISTRY_SOURCE),
                       ("noanswer", NO_ANSWER_SOURCE)):
        (src / f"{name}.cpp").write_text(text)
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    return cache


def _cached(name: str):
    return build.library_path(name, isa.level_in_force(), build.find_compiler())


def _build(name: str):
    """Compile library ``name`` into the cache without loading it; its path."""
    return build.build_library(name, isa.level_in_force())


def _fresh_process(monkeypatch):
    """What a new process sees: nothing loaded yet."""
    monkeypatch.setattr(build, "_loaded", {})


def _count_compiles(monkeypatch) -> list:
    compiled = []
    real = build._compile

    def counting(compiler, flags, sources, target):
        compiled.append(target)
        real(compiler, flags, sources, target)

    monkeypatch.setattr(build, "_compile", counting)
    return compiled


@needs_compiler
def test_build_writes_a_record_of_size_and_sha256(cache):
    lib = build.load_library("other")
    assert lib is not None and lib.hs_answer() == 43
    target = _cached("other")
    record = json.loads(library_record.record_path(target).read_text())
    assert record["size"] == target.stat().st_size
    assert record["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()
    assert sorted(p.name for p in cache.iterdir()) == [target.name, target.name + ".sha256"]  # no temp files
    assert library_record.record_path(target).stat().st_mode & 0o044 == 0o044  # readable where the library is


@needs_compiler
def test_truncated_library_is_rebuilt_in_a_new_process(cache):
    """The probe's case: half of a cached library. Loading it unverified kills the process (SIGBUS, exit 135);
    a new process must rebuild it and run."""
    target = _build("big")
    os.truncate(target, target.stat().st_size // 2)
    script = ("import sys, logging, pathlib\nlogging.basicConfig(level=logging.WARNING)\n"
              "from hybridserve.kernels import build\nbuild.SOURCE_DIR = pathlib.Path(sys.argv[1])\n"
              "lib = build.load_library('big')\nprint('answer', lib.hs_answer())\n")
    env = {**os.environ, "HYBRIDSERVE_KERNEL_CACHE": str(cache), "PYTHONPATH": str(Path(build.__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-c", script, str(build.SOURCE_DIR)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "answer 42" in proc.stdout
    assert str(target) in proc.stderr and "truncated" in proc.stderr  # the WARNING names the file and why
    library_record.verify(target)  # rebuilt whole, with its record


@needs_compiler
def test_another_library_copied_over_is_detected_and_rebuilt(cache, monkeypatch, caplog):
    target = _build("big")
    shutil.copy(_build("other"), target)  # a valid library, other bytes; big's record stays
    _fresh_process(monkeypatch)
    compiled = _count_compiles(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        lib = build.load_library("big")
    assert lib is not None and lib.hs_answer() == 42  # not the copied library's 43
    assert compiled == [target] and str(target) in caplog.text


@needs_compiler
@pytest.mark.parametrize("damage", ["no record", "unreadable record", "same size, other bytes"])
def test_unverifiable_library_is_rebuilt(cache, monkeypatch, caplog, damage):
    target = _build("other")
    record = library_record.record_path(target)
    if damage == "no record":
        record.unlink()
    elif damage == "unreadable record":
        record.write_text("{not json")
    else:
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    _fresh_process(monkeypatch)
    compiled = _count_compiles(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        lib = build.load_library("other")
    assert lib is not None and lib.hs_answer() == 43 and compiled == [target]
    assert str(target) in caplog.text
    library_record.verify(target)


@needs_compiler
def test_unverified_library_is_never_loaded_without_a_compiler(cache, monkeypatch, caplog):
    target = _build("other")
    compiler = build.find_compiler()
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    target.write_bytes(bytes(data))
    _fresh_process(monkeypatch)
    monkeypatch.setattr(build, "_compile", lambda *a: (_ for _ in ()).throw(RuntimeError("compiler failed")))
    monkeypatch.setattr(build, "find_compiler", lambda: compiler)
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        assert build.load_library("other") is None
    assert "compiler failed" in build.unavailable_reason("other") and str(target) in caplog.text


@needs_compiler
def test_library_lacking_a_declared_symbol_is_declined_then_rebuilt(cache, monkeypatch, caplog):
    """A library whose record matches bytes that lack a kernel its source registers (a record forged or
    written for the wrong file): declined with a WARNING naming the file and the symbol, and rebuilt by the
    next process."""
    target = _build("reg")
    shutil.copy(_build("noanswer"), target)
    library_record.write_record(target)  # the record now describes the wrong bytes
    _fresh_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        assert build.load_library("reg") is None
    assert str(target) in caplog.text and "hs_answer" in caplog.text
    assert not library_record.record_path(target).exists()  # dropped: the next start rebuilds
    compiled = _count_compiles(monkeypatch)
    assert _build("reg") == target and compiled == [target]  # (loading it is the next process's)
    library_record.verify(target)


def test_declared_symbols_of_the_real_sources():
    symbols = library_record.declared_symbols(build.SOURCE_DIR / "graph.cpp")
    assert symbols == ["hs_built_isa_level", "hs_registry_size", "hs_registry_entry", "hs_graph_run"]
    gemm = library_record.declared_symbols(build.SOURCE_DIR / "gemm.cpp")
    assert {"hs_linear_bf16", "hs_linear_w8", "hs_moe_experts"} <= set(gemm)  # the registry spans lines


@needs_compiler
def test_pointwise_library_copied_over_the_graph_runner_is_declined(monkeypatch, tmp_path, caplog):
    """The probe's wrong-content case with the real libraries: the pointwise library (from the real cache)
    over the graph runner's file, with a record matching it. The graph runner is declined naming
    hs_graph_run (before: it loaded, and every decode step failed on the missing kernel)."""
    real = build.load_library("pointwise")
    if real is None:
        pytest.skip(f"no pointwise library here: {build.unavailable_reason('pointwise')}")
    cache = tmp_path / "kernel-cache"
    monkeypatch.setenv("HYBRIDSERVE_KERNEL_CACHE", str(cache))
    cache.mkdir()
    target = _cached("graph")
    shutil.copy(real._name, target)
    library_record.write_record(target)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(_abi, "_bound", {})
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        assert _abi.bind("graph") is None
    assert str(target) in caplog.text and "hs_graph_run" in caplog.text
