# Shared fixtures: ISA parametrization that skips (visibly) targets this CPU lacks, a
# reset of the frameworks' process-wide state between tests, a one-rank NCCL group, and
# the loading of a benchmark script as a module.
import importlib.util
import socket
import sys
from pathlib import Path

import pytest
import torch

from cpu_offload import _C, kernels

ALL_ISAS = list(_C.known_isas())


def isa_params():
    """One pytest param per known ISA, skipped with a reason when this CPU lacks it."""
    available = kernels.available_isas()
    return [
        pytest.param(name, marks=pytest.mark.skipif(
            name not in available, reason=f"this CPU lacks {name} (runs {available})"))
        for name in ALL_ISAS
    ]


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


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """HF Trainer and accelerate keep process-wide state in their Accelerator: reset it after
    every test that imported accelerate, so runs do not leak into each other."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def load_benchmark(file_name: str, module_name: str):
    """benchmarks/<file_name> imported as ``module_name`` (registered in sys.modules, where
    dataclasses and pickling look a module up)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / file_name
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def single_rank_group():
    """A one-rank NCCL process group (FSDP2 on one GPU), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
