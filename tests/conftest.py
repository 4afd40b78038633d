import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--cpu-isa", default="auto",
                     help="cap the CPU ISA of the whole run (hybridserve's kernels, oneDNN, ATen): auto, "
                          "generic, avx2, avx512, avx512_bf16, amx; the kernel tests also run every level below")


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """A session-wide folder for tiny checkpoints (built once, reused by every test)."""
    return str(tmp_path_factory.mktemp("checkpoints"))


def pytest_configure(config):
    from hybridserve.kernels import isa

    cap = config.getoption("--cpu-isa")
    isa.cap_torch(cap)  # before torch is imported: oneDNN and ATen read their caps once
    isa.set_cap(cap)
    # Tiny test models: one thread avoids OpenMP stalls on very small ops and keeps runs stable.
    import torch

    torch.set_num_threads(1)


def pytest_report_header(config):
    from hybridserve.kernels import isa

    info = isa.cpu_info()
    top = isa.LEVELS.index(isa.level_in_force())
    tested = [lv for lv in isa.runnable_levels() if isa.LEVELS.index(lv) <= top]
    return (f"cpu: {info.model} ({info.arch}); ISA level in force: {isa.level_in_force()} "
            f"(best {info.best_level}, cap {isa.cap()}); kernel variants tested: {', '.join(tested)}")
