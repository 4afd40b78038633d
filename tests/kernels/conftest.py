import pytest

from hybridserve.kernels import isa

_RUN_LEVEL = isa.level_in_force()  # the run's level: the CPU's best, or the --cpu-isa cap


@pytest.fixture(params=isa.LEVELS)
def isa_level(request):
    """Runs the test with the kernels built for one ISA level, every level this CPU runs up to the run's
    cap; the others are skipped naming the features this CPU lacks (the run's level is restored after)."""
    level = request.param
    missing = isa.cpu_info().missing(level)
    if missing:
        pytest.skip(f"the {level} variant needs {', '.join(missing)}, which this CPU lacks")
    if isa.LEVELS.index(level) > isa.LEVELS.index(_RUN_LEVEL):
        pytest.skip(f"the {level} variant is above this run's --cpu-isa cap ({_RUN_LEVEL})")
    previous = isa.cap()
    isa.set_cap(level)
    try:
        yield level
    finally:
        isa.set_cap(previous)
