import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """A session-wide folder for tiny checkpoints (built once, reused by every test)."""
    return str(tmp_path_factory.mktemp("checkpoints"))
