"""Compile the C++ CPU kernels on first use and cache the shared library.

Each library is built with the system C++ compiler (``$CXX``, else ``g++``, else ``c++``) once per ISA
level (``kernels/isa.py``), with that level's explicit ``-m`` flags (never ``-march=native``), and
cached under ``$HYBRIDSERVE_KERNEL_CACHE`` (default ``~/.cache/hybridserve/kernels``) as
``<name>-<level>-<hash>.so``, the hash over the sources, the flags, the compiler and the machine
type. A library is loaded only for a level this CPU supports, and each one reports the level it was
compiled for (``hs_built_isa_level``), checked at load: a cache shared between hosts never hands
AVX-512 code to an AVX2 CPU. Beside each library the build records its size and sha256
(``kernels/library_record.py``); a cached library is loaded only when its bytes match that record, and
is rebuilt when they do not (truncated, replaced) or when it has no record. A loaded library that lacks
a symbol its source declares is declined, and its record dropped so the next start rebuilds it. No
compiler, or a failed build, means no library: callers then use the plain-PyTorch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hybridserve.kernels import isa, library_record

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c++17",
         "-Wno-psabi"]

# Per-library extra flags: the row-wise kernels reproduce PyTorch's rounding, so no fused multiply-adds.
# (The linear kernels' float32 sums are free to fuse.)
EXTRA_FLAGS = {"pointwise": ["-ffp-contract=off"], "gemm": ["-ffp-contract=fast"]}

_lock = threading.Lock()  # guards _loaded and the per-library build below
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}  # (name, level) -> library
_name_locks: dict[tuple[str, str], threading.Lock] = {}
_failures: dict[tuple[str, str], str] = {}  # (name, level) -> why it is not available


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


def flags(name: str, level: str) -> list[str]:
    """The compiler flags of library ``name`` built for ISA ``level``."""
    return FLAGS + isa.compiler_flags(level) + EXTRA_FLAGS.get(name, [])


def _inputs(name: str) -> list[Path]:
    return [SOURCE_DIR / f"{name}.cpp", *sorted(SOURCE_DIR.glob("*.h"))]


def library_path(name: str, level: str, compiler: str) -> Path:
    """Where library ``name`` built for ``level`` by ``compiler`` is cached."""
    digest = hashlib.sha256()
    for src in _inputs(name):
        digest.update(src.read_bytes())
    digest.update(" ".join(flags(name, level)).encode())
    digest.update(compiler.encode())
    digest.update(platform.machine().encode())
    return cache_dir() / f"{name}-{level}-{digest.hexdigest()[:16]}.so"


def build_library(name: str, level: str) -> Path:
    """Compile library ``name`` for ``level`` into the cache unless it is there; its path. Building
    needs no CPU support for the level (loading does). Raises RuntimeError without a compiler or when
    the build fails."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    target = library_path(name, level, compiler)
    if not _cached_and_verified(target):
        # a few seconds, once per machine, level and source version: say so on stderr
        sys.stderr.write(f"hybridserve: building CPU kernels '{name}' for {level} (once; cached in {target.parent})\n")
        start = time.perf_counter()
        _compile(compiler, flags(name, level), [SOURCE_DIR / f"{name}.cpp"], target)
        logger.info("built %s in %.1f s", target, time.perf_counter() - start)
        library_record.verify(target)  # the bytes just built and recorded (a concurrent builder's are as good)
    return target


def _cached_and_verified(target: Path) -> bool:
    """Whether ``target`` is in the cache with the bytes its build recorded (a WARNING says why not, when it is
    there but unverified: it is then rebuilt over)."""
    if not target.exists():
        return False
    try:
        library_record.verify(target)
    except (library_record.UnverifiedLibrary, OSError) as exc:
        logger.warning("cached CPU kernel library not used, rebuilding it: %s", exc)
        return False
    return True


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
        library_record.write_record(target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_libraries(names: list[str], level: str | None = None) -> dict[str, ctypes.CDLL | None]:
    """``load_library`` for several libraries, building the missing ones in parallel (a compiler per core)."""
    level = level or isa.level_in_force()
    pending = [n for n in names if (n, level) not in _loaded]
    if len(pending) > 1 and find_compiler() is not None:
        with ThreadPoolExecutor(max_workers=min(len(pending), os.cpu_count() or 1)) as pool:
            list(pool.map(lambda n: load_library(n, level), pending))  # each under its own lock, compiles overlap
    return {n: load_library(n, level) for n in names}


def unavailable_reason(name: str, level: str | None = None) -> str | None:
    """Why library ``name`` could not be loaded for ``level`` (None when it was, or was not tried)."""
    return _failures.get((name, level or isa.level_in_force()))


def load_library(name: str, level: str | None = None) -> ctypes.CDLL | None:
    """Build (once) and load ``csrc/<name>.cpp`` for ``level`` (default: the level in force); None when
    that is not possible here (logged once; :func:`unavailable_reason` says why)."""
    level = isa.check_level(level or isa.level_in_force())
    key = (name, level)
    with _lock:
        name_lock = _name_locks.setdefault(key, threading.Lock())
    with name_lock:
        if key in _loaded:
            return _loaded[key]
        lib = None
        try:
            if not isa.cpu_info().supports(level):
                raise RuntimeError(f"this CPU ({isa.cpu_info().best_level} at best) cannot run code built for {level}")
            target = build_library(name, level)
            torch.get_num_threads()  # torch (and its OpenMP runtime) are loaded first, so they are shared
            lib = ctypes.CDLL(str(target))
            missing = library_record.missing_symbols(lib, library_record.declared_symbols(SOURCE_DIR / f"{name}.cpp"))
            if missing:
                lib = None
                library_record.discard_record(target)  # the next start rebuilds it
                raise RuntimeError(f"{target} lacks the symbol(s) {', '.join(missing)} that csrc/{name}.cpp "
                                   f"declares (not a build of it); it is rebuilt on the next start")
            built = lib.hs_built_isa_level()
            if built != isa.LEVELS.index(level):
                lib = None
                raise RuntimeError(f"{target} was built for level {built}, not {level} ({isa.LEVELS.index(level)})")
        except (OSError, RuntimeError, AttributeError) as exc:
            _failures[key] = str(exc)
            logger.warning("CPU kernels %s unavailable at ISA %s, using plain PyTorch paths: %s", name, level, exc)
        _loaded[key] = lib
        return lib
