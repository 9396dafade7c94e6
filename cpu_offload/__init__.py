"""cpu_offload: train with fp32 masters, moments and gradients in host RAM.

The GPU keeps the bf16 compute copy of each parameter; native CPU kernels (AdamW,
SignSGD) run the optimizer step, overlapped with backward.

Public surface (everything else in the package is internal and may change):

- ``offload_optimizer(optimizer, offload="optimizer" | "full" | "none", ...)``: the one setting.
- ``FullCPUOffloadOptimizer``: ``offload="full"`` (the step runs on the CPU during backward).
- ``StateOffloadOptimizer``: ``offload="optimizer"`` (optimizer state in host RAM between steps).
- ``SignSGD``: sign descent as a ``torch.optim.Optimizer``.
- ``cpu_offload.kernels``: the native AdamW / SignSGD kernels on CPU tensors.
- ``cpu_offload.topology``: GPU -> NUMA node -> CPU binding (``python -m cpu_offload.topology``).
- ``cpu_offload.bench``: the kernel micro-benchmark (``python -m cpu_offload.bench``).
"""
import importlib.util as _util
import os as _os

# NOTE: the same as [project] version in pyproject.toml (tests/test_package.py checks it).
__version__ = "0.1.0"


def _missing_native_module() -> str:
    """The message for a package directory that has no built cpu_offload._C."""
    package = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(package)
    if _os.path.exists(_os.path.join(root, "setup.py")) and _os.path.isdir(_os.path.join(root, "csrc")):
        return (
            f"cpu_offload's native module cpu_offload._C is not built in the source tree {package} (this "
            "directory was found first on sys.path, before any installed cpu_offload). Build it in place with "
            f"`python -m pip install -e {root}`, or run from another directory to use an installed cpu_offload."
        )
    return (f"cpu_offload's native module cpu_offload._C is missing from {package}: the installation is "
            "incomplete; reinstall cpu_offload (`python -m pip install --force-reinstall <path to the source>`).")


# NOTE: checked before anything imports the native module, whose own failure would read as
# "cannot import name '_C' from partially initialized module" (a circular import it is not).
if _util.find_spec("cpu_offload._C") is None:
    raise ImportError(_missing_native_module(), name="cpu_offload._C")

from cpu_offload.optim import SignSGD  # noqa: E402
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer  # noqa: E402
from cpu_offload.offload import offload_optimizer  # noqa: E402
from cpu_offload._state.optimizer import StateOffloadOptimizer  # noqa: E402

__all__ = ["SignSGD", "offload_optimizer", "FullCPUOffloadOptimizer", "StateOffloadOptimizer"]
