"""The CPU's instruction-set features, the ISA level the kernels run at, and the cap on it.

Levels, each a superset of the one before:

* ``generic``: no x86 extension assumed; the kernels' portable paths (also every non-x86 CPU).
* ``avx2``: AVX2, FMA and F16C (x86-64-v3 machines: Haswell, Zen 1-3 and later).
* ``avx512``: AVX-512 F, BW, VL and DQ (Skylake-SP, Zen 4 and later).
* ``avx512_bf16``: ``avx512`` plus AVX-512 BF16 and AVX-512 VNNI (Cooper Lake, Sapphire Rapids, Zen 4 and
  later: every CPU with AVX-512 BF16 has VNNI, whose ``vpdpbusd`` sums W8A8's int8 products).
* ``amx``: ``avx512_bf16`` plus the AMX matrix units, AMX-TILE and AMX-BF16 (Sapphire Rapids and later
  Xeons), with the tile-data permission granted to this process (Linux: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``,
  requested by :func:`amx_permission`). A kernel using AMX-INT8 checks ``amx_int8`` itself.

The level in force is the highest one this CPU supports, lowered by the cap (``EngineConfig.cpu_isa``,
``--cpu-isa``), so that a machine can run, and test, every variant below its best. Each kernel library
is compiled per level with that level's explicit ``-m`` flags (never ``-march=native``) and cached
under a key naming the level (``kernels/build.py``), so a binary never runs on a CPU without what it
was built for. The cap also lowers oneDNN's and ATen's ISA (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``) when it is set before torch first dispatches a CPU kernel (the CLI does).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
CPU_ISA_CHOICES = ("auto", *LEVELS)

#: the /proc/cpuinfo flags each level needs (on top of the level below)
_LEVEL_FLAGS = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16"),
}
#: compiler flags each level adds (on top of the level below); generic passes none
_COMPILER_FLAGS = {
    "generic": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
#: the features reported by ``hybridserve env`` (level features plus AMX and AVX-NE-CONVERT)
REPORTED_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                     "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8", "avx_ne_convert")
#: oneDNN's and ATen's names for the cap of each level
_ONEDNN_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX"}
_ATEN_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512",
                    "amx": "avx512"}


@dataclass(frozen=True)
class CpuInfo:
    """What this CPU is and which of the features that matter here it has."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # the model name, as /proc/cpuinfo gives it where it can
    features: frozenset[str]
    vendor: str = ""  # /proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), "" where unknown
    amx_granted: bool = True  # whether the OS lets this process use the AMX tiles (:func:`amx_permission`)

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i386", "i686")

    def missing(self, level: str) -> list[str]:
        """The features ``level`` needs that this CPU lacks (every one of them off x86); for ``amx``, also
        the tile-data permission when the OS refused it."""
        check_level(level)
        needed = [f for lv in LEVELS[:LEVELS.index(level) + 1] for f in _LEVEL_FLAGS[lv]]
        lacking = needed if not self.is_x86 else [f for f in needed if f not in self.features]
        if level == "amx" and not lacking and not self.amx_granted:
            lacking.append("the AMX tile-data permission (arch_prctl refused it)")
        return lacking

    def supports(self, level: str) -> bool:
        """Whether this CPU runs code built for ``level``."""
        return not self.missing(level)

    @property
    def best_level(self) -> str:
        """The highest level this CPU supports."""
        return [lv for lv in LEVELS if self.supports(lv)][-1]


_ARCH_REQ_XCOMP_PERM = 0x1023  # arch_prctl codes (Linux asm/prctl.h) and the AMX tile-data xfeature number
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL_X86_64 = 158


@functools.cache
def amx_permission() -> bool:
    """Whether this process may use the AMX tile registers: on Linux x86-64 the kernel must grant the
    tile-data state first (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), asked here once.
    A refusal (an old kernel, a sandbox) is logged once, and the ``amx`` level is then unavailable."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        rc = libc.syscall(_SYS_ARCH_PRCTL_X86_64, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:
        logger.warning("AMX unavailable: could not ask the kernel for the tile-data permission (%s); "
                       "the kernels run at avx512_bf16", exc)
        return False
    if rc != 0:
        logger.warning("AMX unavailable: the kernel refused the tile-data permission "
                       "(arch_prctl(ARCH_REQ_XCOMP_PERM) errno %d); the kernels run at avx512_bf16",
                       ctypes.get_errno())
        return False
    return True


def check_level(level: str) -> str:
    """``level`` when it names a level, else ValueError naming the allowed ones."""
    if level not in LEVELS:
        raise ValueError(f"cpu_isa level {level!r} is not valid; allowed values: {', '.join(LEVELS)}")
    return level


def _proc_cpuinfo() -> tuple[str, str, set[str]]:
    model, vendor = "", ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not model:
                    model = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, vendor, flags


def _torch_features() -> set[str]:
    """The features torch's cpuinfo reports, where /proc/cpuinfo is not available."""
    import torch

    found = set()
    probes = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    for name, fn in probes.items():
        probe = getattr(torch.cpu, fn, None)
        if probe is not None and probe():
            found.add(name)
    if "avx2" in found:
        found |= {"fma", "f16c"}  # every AVX2 CPU has them
    if "avx512f" in found:
        found |= {"avx512bw", "avx512vl", "avx512dq"}  # torch's AVX-512 check requires them
    if "avx512_bf16" in found:
        found.add("avx512_vnni")  # every AVX-512 BF16 CPU so far has VNNI
    if "amx_tile" in found:
        found.add("amx_bf16")  # every AMX CPU so far has AMX-BF16
    return found


@functools.cache
def cpu_info() -> CpuInfo:
    """This CPU (read once)."""
    arch = platform.machine() or "unknown"
    model, vendor, flags = _proc_cpuinfo()
    if not flags and arch.lower() in ("x86_64", "amd64"):
        flags = _torch_features()
    features = frozenset(f for f in flags if f in REPORTED_FEATURES)
    return CpuInfo(arch=arch, model=model or platform.processor() or arch, features=features, vendor=vendor,
                   amx_granted="amx_tile" in features and amx_permission())


_state_lock = threading.Lock()
_cap = "auto"
_in_force: str | None = None  # level_in_force(), computed once per cap (it is read on every kernel call)


def set_cap(cap: str) -> str:
    """Cap the level the kernels run at (``auto``: no cap) for this process; returns the level in force.

    A cap above what the CPU supports changes nothing (the CPU's best level stays in force)."""
    global _cap, _in_force
    if cap != "auto":
        check_level(cap)
    with _state_lock:
        _cap, _in_force = cap, None
    return level_in_force()


def cap() -> str:
    """The cap set by :func:`set_cap` (``auto`` when none)."""
    return _cap


def level_in_force() -> str:
    """The level the kernels are built for and run at now: the CPU's best, lowered by the cap."""
    global _in_force
    level = _in_force
    if level is None:
        best = cpu_info().best_level
        level = best if _cap == "auto" else LEVELS[min(LEVELS.index(best), LEVELS.index(_cap))]
        _in_force = level
    return level


def runnable_levels() -> tuple[str, ...]:
    """Every level this CPU runs, lowest first (what the kernel tests cover)."""
    return tuple(lv for lv in LEVELS if cpu_info().supports(lv))


def compiler_flags(level: str) -> list[str]:
    """The ``-m`` flags of code built for ``level`` (none for generic, so non-x86 compilers take them)."""
    check_level(level)
    return [f for lv in LEVELS[:LEVELS.index(level) + 1] for f in _COMPILER_FLAGS[lv]]


def at_least(level: str) -> bool:
    """Whether the level in force is ``level`` or above."""
    return LEVELS.index(level_in_force()) >= LEVELS.index(check_level(level))


def cap_torch(cap: str) -> None:
    """Set oneDNN's and ATen's ISA caps for ``cap`` (nothing for ``auto``), unless already set in the
    environment. They take effect only before torch first dispatches a CPU kernel: the CLI calls this
    before it imports torch; :func:`torch_isa_report` says what is in force."""
    if cap == "auto":
        return
    level = check_level(cap)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[level])
    os.environ.setdefault("ATEN_CPU_CAPABILITY", _ATEN_CAPABILITY[level])


def torch_isa_report() -> dict[str, str | None]:
    """ATen's CPU capability in force and the oneDNN cap set in the environment."""
    import torch

    return {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}


def torch_capability_within(level: str) -> bool:
    """Whether ATen's CPU capability in force is no higher than ``level`` allows."""
    import torch

    order = ["DEFAULT", "AVX2", "AVX512"]
    have = torch.backends.cpu.get_cpu_capability().upper()
    allowed = _ATEN_CAPABILITY[check_level(level)].upper()
    return have not in order or order.index(have) <= order.index(allowed)
