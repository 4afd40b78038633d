import pytest

from hybridserve.kernels import isa


def tested_levels() -> list[str]:
    """Every ISA level this CPU runs, up to the run's cap: each kernel variant is tested where it can run."""
    top = isa.level_in_force()
    return [lv for lv in isa.runnable_levels() if isa.LEVELS.index(lv) <= isa.LEVELS.index(top)]


@pytest.fixture(params=tested_levels())
def isa_level(request):
    """Runs the test with the kernels built for one ISA level (the run's level is restored after)."""
    previous = isa.cap()
    isa.set_cap(request.param)
    try:
        yield request.param
    finally:
        isa.set_cap(previous)
