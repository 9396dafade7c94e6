# Shared fixtures (they apply to every test folder): the pool split over every worker, the
# thread count and ISA restored after each test, a reset of the frameworks' process-wide
# state between tests, a one-rank NCCL group, SIGINT raising KeyboardInterrupt. Shared plain
# code lives in helpers.py.
import signal
import sys

import pytest

from cpu_offload import _C, kernels
from helpers import free_port


@pytest.fixture
def split_everything():
    """Makes the pool split even tiny tensor lists over every worker."""
    _C.set_min_elements_per_worker(1)
    yield
    _C.set_min_elements_per_worker(32768)


@pytest.fixture(autouse=True)
def restore_threads_and_isa():
    threads, isa = kernels.get_num_threads(), kernels.isa()
    yield
    kernels.set_num_threads(threads)
    _C.set_isa(isa)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """HF Trainer and accelerate keep process-wide state in their Accelerator: reset it after
    every test that imported accelerate, so runs do not leak into each other."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture
def single_rank_group():
    """A one-rank NCCL process group (FSDP2 on one GPU), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank gloo process group (FSDP2 or DDP on the CPU), destroyed after the test."""
    import torch.distributed as dist

    if not dist.is_gloo_available():
        pytest.skip("torch built without gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt, as at an interactive prompt. NOTE: a process started
    in the background by a non-interactive shell inherits SIGINT ignored, Python then installs
    no handler, and a deferred interrupt is (rightly) dropped: the test would see none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
