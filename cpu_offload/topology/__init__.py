# Topology: GPU -> NUMA node -> CPUs, and a per-local-rank CPU budget.
#
# Scope: read the host topology from sysfs (root injectable for tests), work out for every
# local rank a disjoint CPU set on its GPU's NUMA node and a worker-thread count, and bind
# the process and the native worker pool to that set. torch's intra-op thread count stays
# the user's, unless it exceeds the set's CPUs (then it is lowered to that, with a warning).
# Non-goals: memory policy (host state is placed by first touch from the bound threads),
# cross-host coordination, hot-plugged CPUs, and NUMA nodes without CPUs.
#
# Diagnostic: `python -m cpu_offload.topology [--json]` (__main__.py).

from __future__ import annotations

__all__ = [
    "BindingPlan", "parse_cpulist", "format_cpulist", "local_rank_info", "gpu_pci_addresses",
    "plan_all", "plan_for_rank", "bind",
]

import dataclasses
import importlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence

from cpu_offload._common.cpulist import format_cpulist, parse_cpulist

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BindingPlan:
    """Where one local rank's CPU work runs.

    Args:
        local_rank: the rank's index on this host (torchrun's LOCAL_RANK).
        gpu: the CUDA device index the rank drives, or None without a GPU.
        pci_address: the GPU's PCI address (``dddd:bb:dd.f``), or None when unknown.
        numa_node: the NUMA node the CPUs were taken from, or None when the binding is
            not NUMA-local (GPU reports no node, or the topology files are absent).
        cpus: the rank's CPUs, disjoint from every other local rank's; the process
            affinity. Siblings of one core are adjacent.
        num_threads: native worker threads; one per CPU of ``worker_cpus``.
    """

    local_rank: int
    gpu: int | None
    pci_address: str | None
    numa_node: int | None
    cpus: tuple[int, ...]
    num_threads: int

    def __post_init__(self) -> None:
        if not isinstance(self.cpus, tuple) or not self.cpus:
            raise ValueError(f"BindingPlan.cpus must be a non-empty tuple, got {self.cpus!r}")
        if len(set(self.cpus)) != len(self.cpus) or min(self.cpus) < 0:
            raise ValueError(f"BindingPlan.cpus must be distinct CPU ids >= 0, got {self.cpus!r}")
        if not 1 <= self.num_threads <= len(self.cpus):
            raise ValueError(
                f"BindingPlan.num_threads must be in [1, {len(self.cpus)}], got {self.num_threads}"
            )

    @property
    def worker_cpus(self) -> tuple[int, ...]:
        """The CPUs the native workers are pinned to, one each."""
        return self.cpus[: self.num_threads]

    @property
    def python_cpu(self) -> int | None:
        """The CPU left to the Python/driver thread, or None when it shares with workers."""
        return self.cpus[-1] if self.num_threads < len(self.cpus) else None


# ---------------------------------------------------------------------------- discovery


def local_rank_info(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) from torchrun's variables; (0, 1) when unset."""
    env = os.environ if environ is None else environ
    values = []
    for name, default in (("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        raw = env.get(name)
        try:
            values.append(default if raw is None or raw == "" else int(raw))
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    rank, size = values
    if size < 1 or not 0 <= rank < size:
        if rank > 0 and env.get("LOCAL_WORLD_SIZE") in (None, ""):
            raise ValueError(f"LOCAL_RANK={rank} is set but LOCAL_WORLD_SIZE is not set, so it counts as 1: set it to "
                             "the number of processes on this host (torchrun sets both)")
        raise ValueError(f"LOCAL_RANK={rank} must be in [0, LOCAL_WORLD_SIZE={size})")
    return rank, size


def _nvml_pci_address(index: int, props: object) -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = getattr(props, "uuid", None)
        # NOTE: NVML numbers GPUs physically and ignores CUDA_VISIBLE_DEVICES; the UUID
        # names the same device in both worlds, so it is preferred over the index.
        if uuid is not None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        info = pynvml.nvmlDeviceGetPciInfo(handle)
        return f"{info.domain:04x}:{info.bus:02x}:{info.device:02x}.0"
    except Exception as exc:  # NVML raises its own error types; a failure only loses a hint
        logger.warning("NVML could not report the PCI address of GPU %d: %s", index, exc)
        return None


def gpu_pci_addresses() -> list[str | None]:
    """PCI address of every visible CUDA device, in CUDA index order ([] without CUDA).

    From torch's device properties, else NVML (``pynvml``) when installed, else None.
    """
    import torch

    if not torch.cuda.is_available():
        return []
    addresses: list[str | None] = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        ids = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
        if all(isinstance(v, int) for v in ids):
            addresses.append(f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0")
        else:
            addresses.append(_nvml_pci_address(index, props))
    return addresses


def _read(path: str) -> str | Exception:
    """The file's text, or what kept it from being read."""
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        return e


def _missing(path: str, what: str, require: bool, why: Exception) -> None:
    """Raise (``require``) or warn that the file ``read`` could not give ``what``."""
    # NOTE: a path through a file is missing too
    if isinstance(why, (FileNotFoundError, NotADirectoryError)):
        if require:
            raise FileNotFoundError(f"{what}: {path} does not exist (topology is required here)")
        logger.warning("%s: %s does not exist; not binding to a NUMA node", what, path)
        return
    reason = "not text" if isinstance(why, UnicodeDecodeError) else why.strerror or str(why)
    if require:
        raise RuntimeError(f"{what}: {path} cannot be read ({reason}) (topology is required here)")
    logger.warning("%s: %s cannot be read (%s); not binding to a NUMA node", what, path, reason)


def _gpu_node(gpu: int, pci: str | None, root: str, require: bool) -> int | None:
    """The GPU's NUMA node, or None (with a warning) when it has none or is unknown."""
    if pci is None:
        if require:
            raise RuntimeError(
                f"cannot find the PCI address of GPU {gpu}: this torch build does not report "
                "pci_bus_id and pynvml is not installed"
            )
        logger.warning("GPU %d: PCI address unknown; not binding to a NUMA node", gpu)
        return None
    path = os.path.join(root, "bus", "pci", "devices", pci.lower(), "numa_node")
    text = _read(path)
    if not isinstance(text, str):
        _missing(path, f"NUMA node of GPU {gpu} ({pci})", require, text)
        return None
    try:
        node = int(text.strip())
    except ValueError:
        raise ValueError(f"{path}: expected an integer, got {text.strip()!r}") from None
    if node < 0:
        logger.warning(
            "GPU %d (PCI %s) reports no NUMA node (numa_node=%d in %s); skipping NUMA "
            "binding, CPUs are still split fairly among local ranks",
            gpu, pci, node, path,
        )
        return None
    return node


def _node_cpus(node: int, root: str, require: bool) -> set[int] | None:
    path = os.path.join(root, "devices", "system", "node", f"node{node}", "cpulist")
    text = _read(path)
    if not isinstance(text, str):
        _missing(path, f"CPUs of NUMA node {node}", require, text)
        return None
    return parse_cpulist(text)


def _core_order(cpus: Iterable[int], root: str) -> list[int]:
    """``cpus`` sorted so that SMT siblings sit next to each other, cores in id order.

    NOTE: splitting a plain sorted list would give ranks 0-1 the first hardware threads of
    all cores and ranks 2-3 their siblings (``0-15,32-47``), so ranks would share cores.
    Without topology files every CPU counts as its own core.
    """
    cpus = set(cpus)
    key: dict[int, tuple[int, int]] = {}
    for cpu in cpus:
        topo = os.path.join(root, "devices", "system", "cpu", f"cpu{cpu}", "topology")
        text = _read(os.path.join(topo, "core_cpus_list"))
        if not isinstance(text, str):
            text = _read(os.path.join(topo, "thread_siblings_list"))
        siblings = (parse_cpulist(text) & cpus) if isinstance(text, str) and text else set()
        key[cpu] = (min(siblings | {cpu}), cpu)
    return sorted(cpus, key=key.__getitem__)


# ---------------------------------------------------------------------------- planning


def _split(ordered: list[int], n: int) -> list[tuple[int, ...]]:
    """``n`` consecutive slices of near-equal size (the first ones one larger)."""
    base, extra = divmod(len(ordered), n)
    bounds = [i * base + min(i, extra) for i in range(n + 1)]
    return [tuple(ordered[bounds[i] : bounds[i + 1]]) for i in range(n)]


def plan_all(
    *,
    local_world_size: int | None = None,
    pci_addresses: Sequence[str | None] | None = None,
    sysfs_root: str = "/sys",
    allowed_cpus: Iterable[int] | None = None,
    require_topology: bool = False,
) -> list[BindingPlan]:
    """The plan of every local rank on this host, in local-rank order.

    Local rank k drives CUDA device k (torchrun's convention). Ranks whose GPUs share a
    NUMA node split that node's allowed CPUs into disjoint, near-equal sets in local-rank
    order; ranks without a usable node split the allowed CPUs no node group took.

    Args:
        local_world_size: ranks on this host; default LOCAL_WORLD_SIZE (or 1).
        pci_addresses: PCI address per visible GPU; default :func:`gpu_pci_addresses`.
        sysfs_root: where sysfs is mounted (a fake tree in tests). A file there raises
            ValueError; under a root that does not exist every sysfs file is missing.
        allowed_cpus: CPUs the ranks may use; default ``os.sched_getaffinity(0)``.
        require_topology: raise FileNotFoundError naming the path when a sysfs file is
            missing (RuntimeError when it cannot be read) (full offload), instead of warning
            and binding without NUMA.
    """
    if local_world_size is None:
        local_world_size = local_rank_info()[1]
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    if os.path.exists(sysfs_root) and not os.path.isdir(sysfs_root):
        raise ValueError(f"sysfs_root {os.fspath(sysfs_root)!r} is not a directory; pass where sysfs "
                         "is mounted (/sys)")
    # NOTE: every rank must compute the same split without talking to the others, so the
    # inputs must be the same on every rank: plan before bind() narrows the affinity.
    allowed = set(os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus)
    if not allowed:
        raise ValueError("allowed_cpus is empty: no CPU to run the optimizer on")
    # NOTE: before anything per rank: a mistyped LOCAL_WORLD_SIZE (1e9) must not build lists
    # of that length first. The pools below refuse the same per NUMA node.
    if local_world_size > len(allowed):
        raise ValueError(
            f"{local_world_size} local ranks but only {len(allowed)} CPUs are allowed "
            f"({format_cpulist(allowed)}): a rank would get an empty CPU set; use fewer ranks per "
            "host or widen the CPU affinity"
        )
    addresses = list(gpu_pci_addresses() if pci_addresses is None else pci_addresses)

    gpus: list[int | None]
    if not addresses:
        gpus = [None] * local_world_size  # CPU-only host: budget threads, no NUMA
    elif len(addresses) >= local_world_size:
        gpus = list(range(local_world_size))
    else:
        msg = (
            f"LOCAL_WORLD_SIZE={local_world_size} but only {len(addresses)} GPU(s) are "
            "visible, so the other ranks' GPUs are unknown; make all local GPUs visible to "
            "every rank or pass pci_addresses"
        )
        if require_topology:
            raise ValueError(msg)
        logger.warning("%s; splitting CPUs without NUMA binding", msg)
        gpus, addresses = [None] * local_world_size, []

    nodes: list[int | None] = []
    pools: dict[int | None, set[int]] = {}
    for gpu in gpus:
        node = None if gpu is None else _gpu_node(gpu, addresses[gpu], sysfs_root, require_topology)
        if node is not None and node not in pools:
            cpus = _node_cpus(node, sysfs_root, require_topology)
            if cpus is not None and not cpus & allowed:
                logger.warning(
                    "NUMA node %d of GPU %s has no allowed CPU (node %s, allowed %s); "
                    "not binding to it", node, gpu, format_cpulist(cpus), format_cpulist(allowed),
                )
            if cpus is None or not cpus & allowed:
                node = None
            else:
                pools[node] = cpus & allowed
        nodes.append(node)
    pools[None] = allowed - set().union(*(p for k, p in pools.items() if k is not None))

    plans: list[BindingPlan | None] = [None] * local_world_size
    for node, pool in pools.items():
        ranks = [r for r in range(local_world_size) if nodes[r] == node]
        if not ranks:
            continue
        where = "with no NUMA binding" if node is None else f"on NUMA node {node}"
        if len(pool) < len(ranks):
            raise ValueError(
                f"{len(ranks)} local ranks {where} but only {len(pool)} CPUs are available to "
                f"them ({format_cpulist(pool) or 'none'}): a rank would get an empty CPU set; "
                "use fewer ranks per host or widen the CPU affinity"
            )
        for rank, cpus in zip(ranks, _split(_core_order(pool, sysfs_root), len(ranks))):
            # NOTE: one CPU stays with the Python/driver thread once there are more than two,
            # so it never preempts a worker; with one or two CPUs workers take them all.
            threads = len(cpus) - 1 if len(cpus) > 2 else len(cpus)
            gpu = gpus[rank]
            pci = None if gpu is None else addresses[gpu]
            plans[rank] = BindingPlan(rank, gpu, pci, node, cpus, threads)
    assert all(p is not None for p in plans), "every local rank belongs to one CPU pool"
    return plans  # type: ignore[return-value]


def plan_for_rank(
    local_rank: int | None = None,
    *,
    local_world_size: int | None = None,
    pci_addresses: Sequence[str | None] | None = None,
    sysfs_root: str = "/sys",
    allowed_cpus: Iterable[int] | None = None,
    require_topology: bool = False,
) -> BindingPlan:
    """This rank's plan (LOCAL_RANK / LOCAL_WORLD_SIZE by default); see :func:`plan_all`."""
    if local_rank is None or local_world_size is None:
        env_rank, env_size = local_rank_info()
        local_rank = env_rank if local_rank is None else local_rank
        local_world_size = env_size if local_world_size is None else local_world_size
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"local_rank={local_rank} must be in [0, local_world_size={local_world_size})"
        )
    plans = plan_all(local_world_size=local_world_size, pci_addresses=pci_addresses,
                     sysfs_root=sysfs_root, allowed_cpus=allowed_cpus,
                     require_topology=require_topology)
    return plans[local_rank]


# ---------------------------------------------------------------------------- binding


def bind(plan: BindingPlan) -> None:
    """Confine this process to ``plan.cpus`` and size and pin the native worker pool to match.

    torch's intra-op thread count (``torch.set_num_threads``) is left as it is, unless it
    exceeds the number of CPUs in ``plan.cpus``: then it is lowered to that number and a
    warning says so. Call it before any optimizer state is allocated, so that host state
    is first touched by threads on the right NUMA node.
    """
    import torch

    kernels = importlib.import_module("cpu_offload.kernels")  # lazy: native module
    cpus = set(plan.cpus)
    # NOTE: sched_setaffinity(0) changes the calling thread only; threads started earlier
    # (torch's pools, the native pool, the CUDA driver's) keep their old mask. Every task
    # of the process is updated so nothing keeps running outside the plan.
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # the thread has exited meanwhile
    kernels.set_num_threads(plan.num_threads)
    kernels.pin_threads(list(plan.worker_cpus))
    # NOTE: torch cannot tell whether its count was set by the user, so it is kept: a user's
    # torch.set_num_threads(1) (e.g. to fork workers safely: GNU OpenMP is not fork-safe)
    # must survive the wrap. Only a count above the CPUs the process may now run on, which
    # could only oversubscribe them, is lowered.
    torch_threads = torch.get_num_threads()
    if torch_threads > len(cpus):
        torch.set_num_threads(len(cpus))
        logger.warning(
            "torch.set_num_threads(%d): torch's %d intra-op threads exceed the %d CPUs local rank %d is bound "
            "to (%s)", len(cpus), torch_threads, len(cpus), plan.local_rank, format_cpulist(plan.cpus),
        )
    logger.info(
        "local rank %d bound to CPUs %s (NUMA node %s), %d worker threads",
        plan.local_rank, format_cpulist(plan.cpus), plan.numa_node, plan.num_threads,
    )
