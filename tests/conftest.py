import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """A session-wide folder for tiny checkpoints (built once, reused by every test)."""
    return str(tmp_path_factory.mktemp("checkpoints"))


def pytest_configure(config):
    # Tiny test models: one thread avoids OpenMP stalls on very small ops and keeps runs stable.
    import torch

    torch.set_num_threads(1)
