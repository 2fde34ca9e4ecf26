import pytest
import torch

from tests.rl.helpers import cached_teacher


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory):
    """(model, hf_dir): a tiny byte-level looped model trained briefly (shared with tests/distill)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cached_teacher(tmp_path_factory.getbasetemp())
    finally:
        torch.set_num_threads(n)
