# Tests for cpu_offload.topology: sysfs discovery, the per-rank CPU split, and bind().
# Every topology here is a fake sysfs tree written into tmp_path; bind() runs in a
# subprocess because it changes the CPU affinity of the whole process.

import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from cpu_offload import topology
from cpu_offload.topology import __main__ as topology_cli
from cpu_offload.topology import BindingPlan, format_cpulist, parse_cpulist, plan_all, plan_for_rank

REPO_ROOT = Path(topology.__file__).resolve().parents[1]
PCI = [f"0000:{bus:02x}:00.0" for bus in (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)]


def make_sysfs(root, nodes, gpus=(), siblings=None):
    """Write a fake sysfs: {node: cpulist}, {pci: numa_node or None (file absent)},
    optionally {cpu: core_cpus_list}. Returns the root as a str."""
    for node, cpulist in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for pci, node in dict(gpus).items():
        d = root / "bus" / "pci" / "devices" / pci
        d.mkdir(parents=True)
        if node is not None:
            (d / "numa_node").write_text(f"{node}\n")
    for cpu, cpulist in (siblings or {}).items():
        d = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "core_cpus_list").write_text(cpulist + "\n")
    return str(root)


def assert_disjoint_cover(plans, cpus):
    seen = [c for p in plans for c in p.cpus]
    assert len(seen) == len(set(seen)), f"CPU sets overlap: {[p.cpus for p in plans]}"
    assert set(seen) == set(cpus)


# ---------------------------------------------------------------------------- cpulists


def test_parse_cpulist_mixed_ranges():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("0-15,32-47") == set(range(16)) | set(range(32, 48))
    assert parse_cpulist(" 5 ") == {5}
    assert parse_cpulist("7,2-3,2") == {2, 3, 7}
    assert parse_cpulist("\n") == set()
    for bad in ("3-1", "a", "1-", "0-3,x", "-2"):
        with pytest.raises(ValueError, match="invalid cpulist"):
            parse_cpulist(bad)


def test_format_cpulist_round_trips():
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpulist([]) == ""
    text = "0-15,32-47,64"
    assert format_cpulist(parse_cpulist(text)) == text


# ---------------------------------------------------------------------------- discovery


def test_local_rank_info_reads_torchrun_variables():
    assert topology.local_rank_info({}) == (0, 1)
    assert topology.local_rank_info({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) == (3, 8)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='eight'"):
        topology.local_rank_info({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "eight"})
    with pytest.raises(ValueError, match="LOCAL_RANK=8"):
        topology.local_rank_info({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"})
    # a launcher other than torchrun: the size is not set, and the message says so
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 .* LOCAL_WORLD_SIZE is not set"):
        topology.local_rank_info({"LOCAL_RANK": "1"})


def test_gpu_pci_addresses_from_torch_properties(monkeypatch):
    props = [types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0),
             types.SimpleNamespace(pci_domain_id=1, pci_bus_id=0xC3, pci_device_id=2)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert topology.gpu_pci_addresses() == ["0000:1b:00.0", "0001:c3:02.0"]


def test_gpu_pci_addresses_falls_back_to_nvml(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="1234-abcd"))
    asked = []
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(uuid) or "handle"
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(domain=0, bus=0x86, device=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert topology.gpu_pci_addresses() == ["0000:86:00.0"]
    assert asked == ["GPU-1234-abcd"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert topology.gpu_pci_addresses() == [None]


# ---------------------------------------------------------------------------- plans


def test_one_node_one_gpu(tmp_path, caplog):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: 0})
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        plan = plan_for_rank(0, local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root,
                             allowed_cpus=range(8), require_topology=True)
    assert caplog.records == []
    assert plan == BindingPlan(0, 0, PCI[0], 0, tuple(range(8)), 7)
    assert plan.worker_cpus == tuple(range(7)) and plan.python_cpu == 7


def test_two_nodes_eight_gpus_four_ranks_per_node(tmp_path):
    gpus = {pci: (0 if i < 4 else 1) for i, pci in enumerate(PCI)}
    root = make_sysfs(tmp_path, {0: "0-15", 1: "16-31"}, gpus)
    kw = dict(pci_addresses=PCI, sysfs_root=root, allowed_cpus=range(32), require_topology=True)
    plans = plan_all(local_world_size=8, **kw)

    assert [p.local_rank for p in plans] == list(range(8))
    assert [p.gpu for p in plans] == list(range(8))
    assert [p.pci_address for p in plans] == PCI
    assert [p.numa_node for p in plans] == [0] * 4 + [1] * 4
    for _node, group, node_cpus in ((0, plans[:4], range(16)), (1, plans[4:], range(16, 32))):
        assert_disjoint_cover(group, node_cpus)
        assert [len(p.cpus) for p in group] == [4, 4, 4, 4]
        assert all(p.num_threads == 3 for p in group)
        # in local-rank order: rank k's CPUs all come before rank k+1's
        assert all(max(a.cpus) < min(b.cpus) for a, b in zip(group, group[1:]))
        # the workers cover the node minus one CPU per rank, left to Python
        workers = {c for p in group for c in p.worker_cpus}
        pythons = {p.python_cpu for p in group}
        assert len(workers) == 12 and len(pythons) == 4 and workers | pythons == set(node_cpus)
    # every rank computes the same split on its own
    assert [plan_for_rank(r, local_world_size=8, **kw) for r in range(8)] == plans


def test_uneven_split_is_near_equal(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-13"}, {p: 0 for p in PCI[:4]})
    plans = plan_all(local_world_size=4, pci_addresses=PCI[:4], sysfs_root=root,
                     allowed_cpus=range(14))
    assert [len(p.cpus) for p in plans] == [4, 4, 3, 3]
    assert [p.num_threads for p in plans] == [3, 3, 2, 2]
    assert_disjoint_cover(plans, range(14))


def test_two_cpus_or_fewer_are_all_workers(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-4"}, {p: 0 for p in PCI[:2]})
    plans = plan_all(local_world_size=2, pci_addresses=PCI[:2], sysfs_root=root,
                     allowed_cpus=range(5))
    assert [p.cpus for p in plans] == [(0, 1, 2), (3, 4)]
    assert [p.num_threads for p in plans] == [2, 2]
    assert [p.python_cpu for p in plans] == [2, None]


def test_smt_siblings_stay_with_one_rank(tmp_path):
    # 8 cores with two hardware threads each: CPU c and c+8 share a core
    siblings = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    root = make_sysfs(tmp_path, {0: "0-15"}, {p: 0 for p in PCI[:2]}, siblings)
    plans = plan_all(local_world_size=2, pci_addresses=PCI[:2], sysfs_root=root,
                     allowed_cpus=range(16))
    assert [set(p.cpus) for p in plans] == [{0, 1, 2, 3, 8, 9, 10, 11},
                                            {4, 5, 6, 7, 12, 13, 14, 15}]


def test_gpu_without_numa_node_warns_and_still_splits(tmp_path, caplog):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: -1, PCI[1]: -1})
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        plans = plan_all(local_world_size=2, pci_addresses=PCI[:2], sysfs_root=root,
                         allowed_cpus=range(8), require_topology=True)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("GPU 0" in m and PCI[0] in m and "no NUMA node" in m for m in messages)
    assert any("GPU 1" in m and PCI[1] in m for m in messages)
    assert [p.numa_node for p in plans] == [None, None]
    assert [p.cpus for p in plans] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [p.num_threads for p in plans] == [3, 3]


def test_missing_gpu_numa_file(tmp_path, caplog):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: None})
    path = os.path.join(root, "bus", "pci", "devices", PCI[0], "numa_node")
    kw = dict(local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root, allowed_cpus=range(8))
    with pytest.raises(FileNotFoundError) as err:
        plan_all(require_topology=True, **kw)
    assert path in str(err.value)
    # the diagnostic only reports it
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        (plan,) = plan_all(require_topology=False, **kw)
    assert any(path in r.getMessage() for r in caplog.records)
    assert plan.numa_node is None and plan.cpus == tuple(range(8))


def test_missing_node_directory(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: 1})
    with pytest.raises(FileNotFoundError) as err:
        plan_all(local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root,
                 allowed_cpus=range(8), require_topology=True)
    assert os.path.join(root, "devices", "system", "node", "node1", "cpulist") in str(err.value)



def test_sysfs_root_that_is_a_file_is_refused_by_name(tmp_path, capsys, monkeypatch):
    not_a_dir = tmp_path / "passwd"
    not_a_dir.write_text("root:x:0:0::/root:/bin/sh\n")
    for kw in (dict(pci_addresses=[]), dict(pci_addresses=[PCI[0]]),
               dict(pci_addresses=[PCI[0]], require_topology=True)):
        with pytest.raises(ValueError, match=rf"sysfs_root {str(not_a_dir)!r} is not a directory"):
            plan_all(local_world_size=1, sysfs_root=str(not_a_dir), allowed_cpus=range(4), **kw)
    monkeypatch.setattr(topology, "gpu_pci_addresses", lambda: [])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert topology_cli.main(["--sysfs-root", str(not_a_dir)]) == 1
    assert f"error: sysfs_root {str(not_a_dir)!r} is not a directory" in capsys.readouterr().err
    # A file further down a directory root is a missing path, as documented for those.
    root = make_sysfs(tmp_path / "sys", {0: "0-3"})
    (tmp_path / "sys" / "bus").write_text("")
    path = os.path.join(root, "bus", "pci", "devices", PCI[0], "numa_node")
    with pytest.raises(FileNotFoundError, match=f"{path} does not exist"):
        plan_all(local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root, allowed_cpus=range(4),
                 require_topology=True)
    (plan,) = plan_all(local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root, allowed_cpus=range(4))
    assert plan.numa_node is None and plan.cpus == (0, 1, 2, 3)


def test_full_offload_refuses_a_sysfs_root_that_is_a_file(tmp_path):
    not_a_dir = tmp_path / "passwd"
    not_a_dir.write_text("")
    out = run_python(f"""
        import torch, cpu_offload
        opt = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters())
        try:
            cpu_offload.offload_optimizer(opt, offload="full", sysfs_root={str(not_a_dir)!r})
        except ValueError as e:
            print(e)
    """)
    assert f"sysfs_root {str(not_a_dir)!r} is not a directory" in out

def test_unknown_pci_address_is_an_error_only_when_required(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-3"})
    with pytest.raises(RuntimeError, match="PCI address of GPU 0"):
        plan_all(local_world_size=1, pci_addresses=[None], sysfs_root=root,
                 allowed_cpus=range(4), require_topology=True)
    (plan,) = plan_all(local_world_size=1, pci_addresses=[None], sysfs_root=root,
                       allowed_cpus=range(4))
    assert plan.gpu == 0 and plan.numa_node is None and plan.cpus == (0, 1, 2, 3)


def test_affinity_narrower_than_the_node(tmp_path):
    # a container allowed CPUs 2-7 of node 0 and 20-23 of node 1
    gpus = {PCI[0]: 0, PCI[1]: 0, PCI[2]: 1}
    root = make_sysfs(tmp_path, {0: "0-15", 1: "16-31"}, gpus)
    allowed = {2, 3, 4, 5, 6, 7, 20, 21, 22, 23}
    plans = plan_all(local_world_size=3, pci_addresses=PCI[:3], sysfs_root=root,
                     allowed_cpus=allowed, require_topology=True)
    assert [p.cpus for p in plans] == [(2, 3, 4), (5, 6, 7), (20, 21, 22, 23)]
    assert [p.num_threads for p in plans] == [2, 2, 3]
    assert all(set(p.cpus) <= allowed for p in plans)


def test_node_outside_the_affinity_falls_back_to_other_cpus(tmp_path, caplog):
    root = make_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {PCI[0]: 0, PCI[1]: 0})
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        plans = plan_all(local_world_size=2, pci_addresses=PCI[:2], sysfs_root=root,
                         allowed_cpus={4, 5, 6, 7})
    assert any("no allowed CPU" in r.getMessage() for r in caplog.records)
    assert [p.numa_node for p in plans] == [None, None]
    assert [p.cpus for p in plans] == [(4, 5), (6, 7)]


def test_default_allowed_cpus_is_the_process_affinity(tmp_path):
    allowed = os.sched_getaffinity(0)
    root = make_sysfs(tmp_path, {0: format_cpulist(allowed)}, {PCI[0]: 0})
    (plan,) = plan_all(local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root)
    assert set(plan.cpus) == allowed


def test_more_ranks_than_cpus_is_an_error(tmp_path):
    root = make_sysfs(tmp_path, {0: "0-1"}, {p: 0 for p in PCI[:3]})
    with pytest.raises(ValueError, match="empty CPU set"):
        plan_all(local_world_size=3, pci_addresses=PCI[:3], sysfs_root=root, allowed_cpus={0, 1})
    with pytest.raises(ValueError, match="empty CPU set"):  # CPU-only host, same rule
        plan_all(local_world_size=3, pci_addresses=[], allowed_cpus={0, 1})
    with pytest.raises(ValueError, match="allowed_cpus is empty"):
        plan_all(local_world_size=1, pci_addresses=[], allowed_cpus=set())



def test_far_more_ranks_than_cpus_is_refused_before_any_per_rank_work(tmp_path, capsys, monkeypatch):
    # NOTE: 2**62 ranks: a list with one entry per rank cannot even be asked for, so this
    # fails with MemoryError or OverflowError unless the CPU count is checked first.
    huge = 2 ** 62
    root = make_sysfs(tmp_path, {0: "0-3"}, {PCI[0]: 0, PCI[1]: 0})
    for kw in (dict(pci_addresses=[]), dict(pci_addresses=PCI[:2], sysfs_root=root),
               dict(pci_addresses=PCI[:2], sysfs_root=root, require_topology=True)):
        with pytest.raises(ValueError, match=rf"{huge} local ranks but only 4 CPUs .*empty CPU set"):
            plan_all(local_world_size=huge, allowed_cpus=range(4), **kw)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(huge))
    with pytest.raises(ValueError, match=rf"{huge} local ranks but only 4 CPUs"):
        plan_for_rank(pci_addresses=[], allowed_cpus=range(4))
    monkeypatch.setattr(topology, "gpu_pci_addresses", lambda: [])
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(4)))
    assert topology_cli.main(["--local-world-size", str(huge)]) == 1
    assert f"{huge} local ranks but only 4 CPUs" in capsys.readouterr().err

def test_cpu_only_host_budgets_threads_without_numa():
    plans = plan_all(local_world_size=2, pci_addresses=[], allowed_cpus=range(8))
    assert [(p.gpu, p.pci_address, p.numa_node) for p in plans] == [(None, None, None)] * 2
    assert [p.cpus for p in plans] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_fewer_visible_gpus_than_local_ranks(tmp_path, caplog):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: 0})
    kw = dict(local_world_size=2, pci_addresses=[PCI[0]], sysfs_root=root, allowed_cpus=range(8))
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=2 but only 1 GPU"):
        plan_all(require_topology=True, **kw)
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        plans = plan_all(**kw)
    assert any("only 1 GPU" in r.getMessage() for r in caplog.records)
    assert [(p.gpu, p.cpus) for p in plans] == [(None, (0, 1, 2, 3)), (None, (4, 5, 6, 7))]


def test_plan_for_rank_uses_torchrun_environment(tmp_path, monkeypatch):
    root = make_sysfs(tmp_path, {0: "0-7"}, {p: 0 for p in PCI[:2]})
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = plan_for_rank(pci_addresses=PCI[:2], sysfs_root=root, allowed_cpus=range(8))
    assert (plan.local_rank, plan.gpu, plan.cpus) == (1, 1, (4, 5, 6, 7))
    with pytest.raises(ValueError, match="local_rank=2"):
        plan_for_rank(2, local_world_size=2, pci_addresses=PCI[:2], sysfs_root=root)


def test_binding_plan_validates_its_fields():
    with pytest.raises(ValueError, match="non-empty"):
        BindingPlan(0, None, None, None, (), 1)
    with pytest.raises(ValueError, match="distinct"):
        BindingPlan(0, None, None, None, (1, 1), 1)
    with pytest.raises(ValueError, match="num_threads"):
        BindingPlan(0, None, None, None, (0, 1), 3)


# ---------------------------------------------------------------------------- CLI


def test_cli_table_and_json(tmp_path, monkeypatch, capsys):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: -1, PCI[1]: -1})
    monkeypatch.setattr(topology, "gpu_pci_addresses", lambda: PCI[:2])
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert topology_cli.main(["--sysfs-root", root]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["rank", "gpu", "pci", "address", "node", "cpus", "threads",
                              "python", "cpu"]
    assert out[2].split() == ["0", "0", PCI[0], "-", "0-3", "3", "3"]
    assert out[3].split() == ["1", "1", PCI[1], "-", "4-7", "3", "7"]

    assert topology_cli.main(["--sysfs-root", root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus_visible"] == 2 and data["note"] is None
    assert [p["cpus"] for p in data["plans"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p["pci_address"] for p in data["plans"]] == PCI[:2]


def test_cli_without_gpu_explains_and_budgets(monkeypatch, capsys):
    monkeypatch.setattr(topology, "gpu_pci_addresses", lambda: [])
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert topology_cli.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU is visible" in out
    assert out.splitlines()[-1].split() == ["0", "-", "-", "-", "0-3", "3", "3"]
    assert topology_cli.main(["--local-world-size", "5"]) == 1
    assert "empty CPU set" in capsys.readouterr().err
    for bad in ("0", "-1"):  # 0 used to mean "not given"
        with pytest.raises(SystemExit) as exit_:
            topology_cli.main(["--local-world-size", bad])
        assert exit_.value.code == 2 and "--local-world-size must be >= 1" in capsys.readouterr().err


def run_python(code, stderr=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


def test_cli_runs_on_this_host():
    data = json.loads(run_python("from cpu_offload.topology.__main__ import main; main(['--json'])"))
    assert len(data["plans"]) == max(data["gpus_visible"], 1)
    if data["gpus_visible"] == 0:
        assert "no CUDA GPU is visible" in data["note"]
    assert set(data["plans"][0]["cpus"]) <= set(data["allowed_cpus"])


# ---------------------------------------------------------------------------- bind


def test_bind_sets_affinity_of_every_thread_and_sizes_pools():
    # A stand-in kernels module records the pool calls, so this runs without _C.
    out = run_python("""
        import json, os, sys, threading, types
        calls = []
        stub = types.ModuleType("cpu_offload.kernels")
        stub.set_num_threads = lambda n: calls.append(["set_num_threads", n])
        stub.pin_threads = lambda cpus: calls.append(["pin_threads", list(cpus)])
        sys.modules["cpu_offload.kernels"] = stub
        import torch
        from cpu_offload.topology import BindingPlan, bind
        before = sorted(os.sched_getaffinity(0))
        cpu = before[-1]
        started, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=lambda: (started.set(), stop.wait()))
        t.start(); started.wait()
        bind(BindingPlan(0, None, None, None, (cpu,), 1))
        tasks = {tid: sorted(os.sched_getaffinity(int(tid)))
                 for tid in os.listdir("/proc/self/task")}
        stop.set(); t.join()
        print(json.dumps({"before": before, "after": sorted(os.sched_getaffinity(0)),
                          "thread": tasks[str(t.native_id)], "tasks": tasks, "calls": calls,
                          "torch": torch.get_num_threads()}))
    """)
    data = json.loads(out)
    cpu = data["before"][-1]
    assert data["after"] == [cpu]
    assert data["thread"] == [cpu], "a thread started before bind() kept its old mask"
    assert all(mask == [cpu] for mask in data["tasks"].values())
    assert data["calls"] == [["set_num_threads", 1], ["pin_threads", [cpu]]]
    assert data["torch"] == 1


def test_bind_pins_the_native_pool():
    out = run_python("""
        import json, os, torch
        from cpu_offload import kernels
        from cpu_offload.topology import BindingPlan, bind
        before = sorted(os.sched_getaffinity(0))
        kernels._C.set_num_threads(len(before) + 1)  # a different pool size (more than the mask: native only)
        kernels.pin_threads(None)
        bind(BindingPlan(0, None, None, None, (before[-1],), 1))
        print(json.dumps({"before": before, "after": sorted(os.sched_getaffinity(0)),
                          "tasks": [sorted(os.sched_getaffinity(int(t)))
                                    for t in os.listdir("/proc/self/task")],
                          "pool": kernels.get_num_threads(), "pinned": kernels.get_pinned_cpus(),
                          "torch": torch.get_num_threads()}))
    """)
    data = json.loads(out)
    cpu = data["before"][-1]
    assert data["after"] == [cpu]
    assert all(mask == [cpu] for mask in data["tasks"])
    assert data["pool"] == 1
    assert list(data["pinned"]) == [cpu]
    assert data["torch"] == 1


def test_wrapping_keeps_the_users_torch_thread_count():
    # Binding sizes and pins the library's own workers; torch's intra-op count is the user's.
    # NOTE: with 2 threads GNU OpenMP would hang the forked child's first parallel op.
    out = run_python("""
        import json, os, signal, torch, torch.nn as nn
        import cpu_offload
        from cpu_offload import kernels
        torch.set_num_threads(1)
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
        model = nn.Linear(256, 256)
        opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full")
        after = torch.get_num_threads()
        model(torch.randn(512, 256).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        (torch.randn(1024, 1024) @ torch.randn(1024, 1024)).sum()
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a hung child dies of SIGALRM (default action) instead of lingering
            a = torch.randn(2048, 2048)
            (a @ a).sum(); torch.randn(1 << 22).exp().sum()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"torch": after, "pool": kernels.get_num_threads(), "plan": opt.binding.num_threads,
                          "child": os.waitstatus_to_exitcode(status)}))
    """)
    data = json.loads(out)
    assert data["torch"] == 1
    assert data["pool"] == data["plan"] >= 1
    assert data["child"] == 0


def test_bind_lowers_only_a_torch_thread_count_above_its_cpus_and_says_so():
    out, err = run_python("""
        import json, logging, os, sys, torch
        from cpu_offload.topology import BindingPlan, bind
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        allowed = sorted(os.sched_getaffinity(0))
        plan = BindingPlan(0, None, None, None, tuple(allowed), len(allowed))
        torch.set_num_threads(1)
        bind(plan)
        kept = torch.get_num_threads()
        print("---", file=sys.stderr, flush=True)
        torch.set_num_threads(len(allowed) + 2)
        bind(plan)
        print(json.dumps({"allowed": allowed, "kept": kept, "lowered": torch.get_num_threads()}))
    """, stderr=True)
    data = json.loads(out)
    n = len(data["allowed"])
    assert data["kept"] == 1
    assert data["lowered"] == n
    before, after = err.split("---")
    assert "intra-op" not in before, before
    assert f"torch.set_num_threads({n})" in after and f"{n + 2} intra-op threads" in after, after


def test_every_full_offload_optimizer_binds_not_only_the_first_of_the_process():
    """The binding ran at the first full-offload construction of a process only: a torch
    thread count raised above the rank's CPUs after it, or an affinity widened after it, stayed
    for the next optimizer, unlike what the docs promise for each."""
    out, err = run_python("""
        import json, logging, os, sys, torch, torch.nn as nn
        import cpu_offload
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)

        def wrap():
            model = nn.Linear(64, 64)
            opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full")
            model(torch.randn(8, 64).to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.close()
            return opt.binding

        allowed = sorted(os.sched_getaffinity(0))
        plan = wrap()
        print("---", file=sys.stderr, flush=True)
        torch.set_num_threads(len(allowed) + 3)
        os.sched_setaffinity(0, allowed)
        wrap()
        print(json.dumps({"plan": sorted(plan.cpus), "torch": torch.get_num_threads(),
                          "affinity": sorted(os.sched_getaffinity(0))}))
    """, stderr=True)
    data = json.loads(out)
    n = len(data["plan"])
    assert data["torch"] == n
    assert data["affinity"] == data["plan"]
    after = err.split("---")[1]
    assert f"torch.set_num_threads({n})" in after, after


@pytest.mark.parametrize("which", ["numa_node", "cpulist"])
@pytest.mark.parametrize("how, reason", [("directory", "Is a directory"), ("binary", "not text")])
def test_a_sysfs_file_that_cannot_be_read_is_named_not_a_traceback(tmp_path, caplog, capsys, monkeypatch,
                                                                    which, how, reason):
    root = make_sysfs(tmp_path, {0: "0-7"}, {PCI[0]: 0})
    path = Path(root, "bus", "pci", "devices", PCI[0], "numa_node") if which == "numa_node" else \
        Path(root, "devices", "system", "node", "node0", "cpulist")
    path.unlink()
    if how == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe0\n")
    kw = dict(local_world_size=1, pci_addresses=[PCI[0]], sysfs_root=root, allowed_cpus=range(8))
    with pytest.raises(RuntimeError, match=f"{path} cannot be read \\({reason}\\) \\(topology is required here\\)"):
        plan_all(require_topology=True, **kw)
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        (plan,) = plan_all(**kw)
    assert any(f"{path} cannot be read ({reason}); not binding" in r.getMessage() for r in caplog.records)
    assert plan.numa_node is None and plan.cpus == tuple(range(8))
    monkeypatch.setattr(topology, "gpu_pci_addresses", lambda: [PCI[0]])
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(8)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=topology.__name__):
        assert topology_cli.main(["--sysfs-root", root]) == 0
    assert any(f"{path} cannot be read ({reason})" in r.getMessage() for r in caplog.records)
    assert capsys.readouterr().out.splitlines()[2].split() == ["0", "0", PCI[0], "-", "0-7", "7", "7"]
