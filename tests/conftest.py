import os

import pytest
import torch

# Keep the CI machine's two cores for the two ranks of distributed tests.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_leaked_distributed_state():
    """Undo what a single-device fit of a DDP strategy leaves in this process: its default process group (ranks forked
    later would inherit it: "trying to initialize the default process group twice") and MASTER_PORT & co. in
    os.environ (jobs started later would all rendezvous on that one port)."""
    environ = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
