import os

import pytest
import torch

# Keep the CI machine's two cores for the two ranks of distributed tests.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Every process the tests start (spawned ranks, launched jobs; forked ranks inherit pytest's faulthandler) prints its
# Python threads' stacks if it crashes (SIGSEGV, SIGABRT): a rank of Lightning's spawn launcher once aborted at exit
# in the slow suite, with only "terminate called without an active exception" to show for it.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# Ranks are forked (tests/helpers/distributed.py). Autograd decides once, at a process's first backward, whether it
# needs device threads, and a forked child of a process that started them cannot run backward ("autograd's threading
# in combination with fork"). After an in-process torch.compile that first backward starts them even without a GPU,
# so a compiling test followed by a fit and then forked ranks failed, depending on the order tests ran in. One
# backward now, before any test compiles, settles it on a machine without a GPU (the suite's: no device, no threads).
torch.ones(1, requires_grad=True).sum().backward()


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
