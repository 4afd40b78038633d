"""Compile the C++ CPU kernels on first use and cache the shared library.

The library is built with the system C++ compiler (``$CXX``, else ``g++``, else ``c++``) for this
machine's CPU (``-march=native``) and cached under ``$HYBRIDSERVE_KERNEL_CACHE`` (default
``~/.cache/hybridserve/kernels``), keyed by a hash of the sources, the flags and the compiler. No
compiler, or a failed build, means no library: callers then use the plain-PyTorch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c++17"]

# Per-library extra flags: the row-wise kernels reproduce PyTorch's rounding, so no fused multiply-adds.
EXTRA_FLAGS = {"pointwise": ["-ffp-contract=off"]}

_lock = threading.Lock()  # guards _loaded and the per-name build below
_loaded: dict[str, ctypes.CDLL | None] = {}
_name_locks: dict[str, threading.Lock] = {}


def cache_dir() -> Path:
    """Where built libraries are kept."""
    root = os.environ.get("HYBRIDSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hybridserve" / "kernels"


def find_compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags(name: str) -> list[str]:
    return FLAGS + EXTRA_FLAGS.get(name, [])


def _library_path(name: str, inputs: list[Path], compiler: str) -> Path:
    digest = hashlib.sha256()
    for src in inputs:
        digest.update(src.read_bytes())
    digest.update(" ".join(_flags(name)).encode())
    digest.update(compiler.encode())
    digest.update(os.uname().machine.encode())
    return cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"


def _compile(compiler: str, flags: list[str], sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, *map(str, sources), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each install a complete file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_libraries(names: list[str]) -> dict[str, ctypes.CDLL | None]:
    """``load_library`` for several libraries, building the missing ones in parallel (a compiler per core)."""
    pending = [n for n in names if n not in _loaded]
    if len(pending) > 1 and find_compiler() is not None:
        with ThreadPoolExecutor(max_workers=min(len(pending), os.cpu_count() or 1)) as pool:
            list(pool.map(load_library, pending))  # each one under its own lock section, compiles overlap
    return {n: load_library(n) for n in names}


def load_library(name: str) -> ctypes.CDLL | None:
    """Build (once) and load ``csrc/<name>.cpp``; None when that is not possible here (logged once)."""
    with _lock:
        name_lock = _name_locks.setdefault(name, threading.Lock())
    with name_lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        compiler = find_compiler()
        if compiler is None:
            logger.warning("no C++ compiler found; CPU kernels are off (plain PyTorch paths are used)")
        else:
            sources = [SOURCE_DIR / f"{name}.cpp"]
            try:
                target = _library_path(name, sources + sorted(SOURCE_DIR.glob("*.h")), compiler)
                if not target.exists():
                    # a few seconds, once per machine and source version: say so on stderr
                    sys.stderr.write(f"hybridserve: building CPU kernels '{name}' (once; cached in {target.parent})\n")
                    start = time.perf_counter()
                    _compile(compiler, _flags(name), sources, target)
                    logger.info("built %s in %.1f s", target, time.perf_counter() - start)
                torch.get_num_threads()  # torch (and its OpenMP runtime) are loaded first, so they are shared
                lib = ctypes.CDLL(str(target))
            except (OSError, RuntimeError) as exc:
                logger.warning("CPU kernels %s unavailable, using plain PyTorch paths: %s", name, exc)
        _loaded[name] = lib
        return lib
