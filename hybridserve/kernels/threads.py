"""The engine's CPU threads: how many, and how they wait for each other between parallel regions.

**Thread count** (``EngineConfig.cpu_threads`` / ``--cpu-threads``, ``cpu_reserved_cores`` /
``--cpu-reserved-cores``). ``auto`` is every core this process may use (``os.sched_getaffinity``, one
thread per physical core where ``/sys`` gives the topology), less the reserved ones; a thread count that
torch was already lowered to before the engine started (``torch.set_num_threads``, ``OMP_NUM_THREADS``)
is kept. The engine applies it with ``torch.set_num_threads`` when it starts: torch's operators, oneDNN
and hybridserve's compiled kernels share one OpenMP runtime (``kernels/build.py``), so they all follow it.
With ``cpu_adaptive_threads`` that count is a ceiling: the engine lowers it between steps while other
processes want some of the cores (``kernels/thread_share.py``).

**Wait policy** (``cpu_wait_policy`` / ``--cpu-wait-policy``): what an OpenMP thread does when it waits
at a barrier or for the next parallel region. Spinning answers in nanoseconds while every thread has a
core of its own; when another process shares the cores, a spinning thread burns the time slice of the
peer it waits for, and one decode step (hundreds of parallel regions) can take several times its fair
share. The policies, as environment variables of the OpenMP runtime (GNU libgomp, the one torch's Linux
wheels ship):

* ``spin``: ``OMP_WAIT_POLICY=ACTIVE``: spin until work comes (libgomp: 3e10 spins, minutes).
* ``bounded``: ``GOMP_SPINCOUNT`` = :data:`BOUNDED_SPIN_COUNT`: spin briefly, then sleep in the kernel.
* ``passive``: ``OMP_WAIT_POLICY=PASSIVE``: sleep at once (every wake-up goes through the kernel).
* ``openmp``: set nothing: the runtime's own default (libgomp: 300,000 spins, milliseconds, then sleep).
* ``auto``: :data:`AUTO_WAIT_POLICY`, chosen by measurement (``docs/performance.md``, "Shared cores").

The runtime reads these variables once, when it is loaded, that is when torch is imported. The
``hybridserve`` command applies the option before it imports torch (:func:`apply_wait_policy`); a
process that has imported torch already (the offline ``LLM`` API, usually) keeps the policy it loaded
with, and the engine logs a warning when that is not the one asked for. To choose it there, call
:func:`apply_wait_policy` (or set ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``) before importing torch.
Variables the user set are respected under ``auto`` (and said so in the log); an explicit policy
replaces them, with a warning naming them.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

WAIT_POLICIES = ("auto", "spin", "bounded", "passive", "openmp")
#: the policy ``auto`` stands for (measured: docs/performance.md, "Shared cores")
AUTO_WAIT_POLICY = "bounded"
#: libgomp spins of the ``bounded`` policy before a waiting thread sleeps (about 35 us on the Xeon measured in
#: docs/performance.md, "Shared cores", where 1,000 to 30,000 were tried)
BOUNDED_SPIN_COUNT = 3_000
#: the OpenMP runtime's variables a wait policy sets
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: libgomp's spin counts: OMP_WAIT_POLICY=ACTIVE, and neither variable set
_GOMP_ACTIVE_SPINS = 30_000_000_000
_GOMP_DEFAULT_SPINS = 300_000
_GOMP_INFINITE = 2**64 - 1


def wait_policy_environment(policy: str) -> dict[str, str]:
    """The OpenMP variables of ``policy`` (``auto`` resolved); empty for ``openmp``."""
    policy = check_wait_policy(policy)
    policy = AUTO_WAIT_POLICY if policy == "auto" else policy
    return {"spin": {"OMP_WAIT_POLICY": "ACTIVE"}, "bounded": {"GOMP_SPINCOUNT": str(BOUNDED_SPIN_COUNT)},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "openmp": {}}[policy]


def check_wait_policy(policy: object) -> str:
    """``policy`` in canonical form, else ValueError naming the allowed values."""
    if not isinstance(policy, str) or policy.lower() not in WAIT_POLICIES:
        raise ValueError(f"cpu_wait_policy={policy!r} is not valid; allowed values: {', '.join(WAIT_POLICIES)}")
    return policy.lower()


def gomp_spin_count(env: dict[str, str]) -> int:
    """The spin count libgomp runs with under the variables ``env`` (its own parsing rules: GOMP_SPINCOUNT
    first, a number with an optional k/M/G/T suffix or INFINITE; else OMP_WAIT_POLICY)."""
    raw = (env.get("GOMP_SPINCOUNT") or "").strip()
    if raw:
        if raw.lower() in ("infinite", "infinity"):
            return _GOMP_INFINITE
        scale = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(raw[-1].lower(), 1)
        digits = raw[:-1] if scale != 1 else raw
        if digits.strip().isdigit():
            return int(digits) * scale
    wait = (env.get("OMP_WAIT_POLICY") or "").strip().lower()
    return {"active": _GOMP_ACTIVE_SPINS, "passive": 0}.get(wait, _GOMP_DEFAULT_SPINS)


def policy_of(env: dict[str, str]) -> str:
    """The name of the policy the OpenMP variables ``env`` give (``custom`` for other values)."""
    if not any(env.get(v) for v in WAIT_VARIABLES):
        return "openmp"
    for name in ("spin", "bounded", "passive"):
        if gomp_spin_count(env) == gomp_spin_count(wait_policy_environment(name)):
            return name
    return "custom"


def openmp_runtime() -> str | None:
    """The OpenMP runtime loaded in this process (libgomp, libomp, libiomp5), None when none is (yet)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return "unknown" if "torch" in sys.modules else None
    for name in ("libgomp", "libiomp5", "libomp"):
        if f"/{name}" in maps or f"{name}-" in maps:
            return name
    return None


@dataclass(frozen=True)
class WaitPolicy:
    """The wait policy in force, how it came to be, and what was asked for."""

    requested: str  # the option (auto, spin, bounded, passive, openmp)
    in_force: str  # the policy the runtime runs with: spin, bounded, passive, openmp, custom
    spin_count: int  # libgomp's spins before a waiting thread sleeps
    variables: dict[str, str]  # OMP_WAIT_POLICY / GOMP_SPINCOUNT as the runtime read them
    source: str  # "option", "environment" (the user's variables) or "runtime default"
    note: str | None = None  # why the policy asked for is not the one in force

    def as_dict(self) -> dict:
        return {**asdict(self), "description": self.describe()}

    def describe(self) -> str:
        spins = "no spinning" if self.spin_count == 0 else (
            "spins until work comes" if self.spin_count >= _GOMP_ACTIVE_SPINS else f"{self.spin_count} spins")
        variables = ", ".join(f"{k}={v}" for k, v in self.variables.items()) or "no OpenMP variables set"
        by = {"option": f"cpu_wait_policy={self.requested}", "environment": "the environment (kept)",
              "runtime default": "the OpenMP runtime's default"}.get(self.source, self.source)
        return f"{self.in_force} ({spins}; {variables}; from {by})"


_applied: WaitPolicy | None = None  # what apply_wait_policy set before the runtime loaded


def _variables(environ) -> dict[str, str]:
    return {v: environ[v] for v in WAIT_VARIABLES if environ.get(v)}


def apply_wait_policy(policy: str, environ=None) -> WaitPolicy:
    """Set the OpenMP variables of ``policy`` in ``environ`` (``os.environ``) for the runtime to read when it
    loads: call before importing torch (the CLI does). Under ``auto``, variables the user set are kept;
    an explicit policy replaces them (its ``note`` names them; the engine logs it). Once the runtime is
    loaded nothing changes (the ``note`` says why)."""
    global _applied
    policy = check_wait_policy(policy)
    environ = os.environ if environ is None else environ
    if openmp_runtime() is not None:
        return wait_policy_in_force(policy, environ)
    user = _variables(environ)
    wanted = wait_policy_environment(policy)
    note = None
    if policy == "auto" and user:
        source = "environment"
    else:
        if user and user != wanted:
            note = (f"cpu_wait_policy={policy} replaced {', '.join(f'{k}={v}' for k, v in user.items())} "
                    "set in the environment")
        for name in WAIT_VARIABLES:
            environ.pop(name, None)
        environ.update(wanted)
        source = "option" if wanted else "runtime default"
    variables = _variables(environ)
    _applied = WaitPolicy(requested=policy, in_force=policy_of(variables), spin_count=gomp_spin_count(variables),
                          variables=variables, source=source, note=note)
    return _applied


def wait_policy_in_force(requested: str = "auto", environ=None) -> WaitPolicy:
    """The wait policy the loaded runtime runs with (what :func:`apply_wait_policy` set, else the environment
    as it is now), with a ``note`` when it is not the ``requested`` one: an explicit policy that differs, or
    ``auto`` where nobody chose one before torch was imported (the runtime's default is in force)."""
    requested = check_wait_policy(requested)
    if _applied is not None:
        variables, source = _applied.variables, _applied.source
        if _applied.requested == requested:
            return _applied
    else:
        variables = _variables(os.environ if environ is None else environ)
        source = "environment" if variables else "runtime default"
    in_force = policy_of(variables)
    wanted = AUTO_WAIT_POLICY if requested == "auto" else requested
    missed = in_force != wanted and (requested != "auto" or source == "runtime default")
    asked = f"{requested} ({wanted})" if requested == "auto" else requested
    note = (f"cpu_wait_policy={asked} is not in force ({in_force} is): the OpenMP runtime read its "
            "wait policy when torch was imported, before the engine started; pass --cpu-wait-policy to the "
            "hybridserve command, or call hybridserve.kernels.threads.apply_wait_policy() (or set OMP_WAIT_POLICY / "
            "GOMP_SPINCOUNT) before importing torch") if missed else None
    return WaitPolicy(requested=requested, in_force=in_force, spin_count=gomp_spin_count(variables),
                      variables=dict(variables), source=source, note=note)


# ---------------------------------------------------------------------------------------------- thread count


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cores() -> int:
    """Physical cores among the CPUs this process may run on (the logical count where /sys does not say)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return usable_cpus()
    cores = set()
    for cpu in cpus:
        try:
            topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
            with open(f"{topology}/core_id") as f, open(f"{topology}/physical_package_id") as g:
                cores.add((g.read().strip(), f.read().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def check_thread_options(cpu_threads: object, cpu_reserved_cores: object) -> tuple[int | None, int]:
    """``(cpu_threads, cpu_reserved_cores)`` validated against this machine (``None``: auto), else
    ValueError naming the bad value and the allowed range."""
    cpus, cores = usable_cpus(), usable_cores()
    if isinstance(cpu_reserved_cores, bool) or not isinstance(cpu_reserved_cores, int) \
            or not 0 <= cpu_reserved_cores < cores:
        raise ValueError(f"cpu_reserved_cores={cpu_reserved_cores!r} is not valid; allowed: 0 to {cores - 1} "
                         f"(this process may use {cores} cores, and the engine needs one)")
    if isinstance(cpu_threads, str) and cpu_threads.lower() == "auto":
        cpu_threads = None
    if cpu_threads is not None:
        top = cpus - cpu_reserved_cores
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or not 1 <= cpu_threads <= top:
            reserved = f", less cpu_reserved_cores={cpu_reserved_cores}" if cpu_reserved_cores else ""
            raise ValueError(f"cpu_threads={cpu_threads!r} is not valid; allowed: auto or 1 to {top} (this process "
                             f"may run on {cpus} CPUs{reserved})")
    return cpu_threads, cpu_reserved_cores


@dataclass(frozen=True)
class ThreadSetup:
    """The engine's CPU threads: how many, why, and how they wait."""

    threads: int
    cores: int  # physical cores this process may use
    cpus: int  # logical CPUs this process may run on
    reserved: int  # cores left to the front end
    reason: str  # how the count was chosen
    wait_policy: WaitPolicy

    def as_dict(self) -> dict:
        return {**asdict(self), "wait_policy": self.wait_policy.as_dict()}

    def describe(self) -> str:
        return (f"CPU threads: {self.threads} ({self.reason}); OpenMP wait policy: {self.wait_policy.describe()}")


_torch_baseline: int | None = None  # torch's thread count before the engine first set it
_last_set: int | None = None  # the count the engine set last


def resolve_threads(cpu_threads: int | None, cpu_reserved_cores: int, torch_threads: int) -> tuple[int, str]:
    """The thread count of the options (``cpu_threads`` None: auto) and a phrase saying how it was chosen.
    ``torch_threads`` is torch's count before the engine set any (kept when it is below the auto count)."""
    cpu_threads, reserved = check_thread_options(cpu_threads, cpu_reserved_cores)
    if cpu_threads is not None:
        return cpu_threads, "cpu_threads"
    cores = usable_cores()
    budget = cores - reserved
    left = f", {reserved} left to the front end" if reserved else ""
    if torch_threads < budget:
        return max(1, torch_threads), (f"auto: torch was set to {torch_threads} before the engine started "
                                       f"(torch.set_num_threads or OMP_NUM_THREADS); {cores} cores usable{left}")
    return budget, f"auto: {cores} cores usable{left}"


def setup_threads(cpu_threads: int | None = None, cpu_reserved_cores: int = 0,
                  cpu_wait_policy: str = "auto") -> ThreadSetup:
    """Apply the thread count (``torch.set_num_threads``) and report the wait policy in force, logging a
    warning when the one asked for cannot take effect (torch was imported before it could be set)."""
    global _torch_baseline, _last_set
    import torch

    now = torch.get_num_threads()
    if _last_set is None or now != _last_set:  # the first engine, or someone changed it since: a new baseline
        _torch_baseline = now
    assert _torch_baseline is not None  # (set above on the first call)
    threads, reason = resolve_threads(cpu_threads, cpu_reserved_cores, _torch_baseline)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _last_set = threads
    policy = wait_policy_in_force(cpu_wait_policy)
    setup = ThreadSetup(threads=threads, cores=usable_cores(), cpus=usable_cpus(), reserved=cpu_reserved_cores,
                        reason=reason, wait_policy=policy)
    if policy.note is not None:
        (logger.warning if cpu_wait_policy != "auto" else logger.info)("%s", policy.note)
    logger.info("%s", setup.describe())
    return setup
