import os

import pytest
import torch

# Keep the CI machine's two cores for the two ranks of distributed tests.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
