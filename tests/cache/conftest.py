import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one thread (and the test machine's cores are shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
