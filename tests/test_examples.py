# CPU smoke tests of examples/train_fsdp.py and of benchmarks/e2e.py's report code.
#
# Scope: the example trains a tiny model for 3 steps on CPU with gloo, in 1 process and
# in 2 processes, with --offload none always and with "optimizer" / "full" once
# cpu_offload provides them (skipped with the reason until then); a 2-process run saved
# at step 2 and resumed reproduces step 3 exactly; 1 process × 4 rows and 2 processes
# × 2 rows see the same samples, so their first loss agrees. The benchmark's table,
# ratios, targets, JSON and plot are checked on fake measurements: no GPU needed.
#
# NOTE: to keep the suite fast on a small CI host, each world size is one process per
# rank that imports torch once and calls the example's main(argv) for every case
# (this file, run as a script, is that driver); the cases run on one shared gloo group.

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--vocab-size", "256", "--d-model", "64", "--n-layers", "2",
        "--n-heads", "4", "--ffn-dim", "128", "--seq-len", "32", "--warmup-steps", "1", "--lr", "1e-3"]
STEPS = 3
DRIVER_TIMEOUT_S = 240


# ------------------------------------------------------------ what exists now


def _offload_modes() -> dict:
    """mode -> None when its code exists, else the reason to skip it."""
    try:
        import cpu_offload
    except ImportError as exc:  # the example requires the package
        return {m: f"cpu_offload not importable: {exc}" for m in ("none", "optimizer", "full")}
    has_wrap = hasattr(cpu_offload, "offload_optimizer")
    has_full = has_wrap and hasattr(cpu_offload, "FullCPUOffloadOptimizer")
    return {
        "none": None,
        "optimizer": None if has_wrap else "cpu_offload.offload_optimizer does not exist yet",
        "full": None if has_full else "cpu_offload.offload_optimizer / FullCPUOffloadOptimizer do not exist yet",
    }


def _has_sign_sgd() -> bool:
    try:
        import cpu_offload
    except ImportError:
        return False
    return hasattr(cpu_offload, "SignSGD")


MODES = _offload_modes()
AVAILABLE = [m for m, why in MODES.items() if why is None]


def _cases(world: int, ckpt_root: str) -> list[dict]:
    """The runs for one world size: name, mode, argv (metrics path added by the driver)."""
    cases = []
    if world == 1:
        for mode in AVAILABLE:  # 1 process x 4 rows x 2 micro-batches
            cases.append({"name": f"{mode}_1p", "mode": mode,
                          "argv": ["--offload", mode, "--batch-size", "4", "--grad-accum", "2"]})
        cases.append({"name": "none_tied_norope_1p", "mode": "none",
                      "argv": ["--offload", "none", "--batch-size", "2", "--tie-embeddings", "--no-rope"]})
        if _has_sign_sgd():
            for mode in [m for m in ("none", "full") if m in AVAILABLE]:
                cases.append({"name": f"{mode}_sign_sgd_1p", "mode": mode,
                              "argv": ["--offload", mode, "--optimizer", "sign_sgd", "--batch-size", "2"]})
        return cases
    for mode in AVAILABLE:  # 2 processes x 2 rows x 2 micro-batches: the same samples
        common = ["--offload", mode, "--batch-size", "2", "--grad-accum", "2"]
        ckpt = os.path.join(ckpt_root, mode)
        cases.append({"name": f"{mode}_2p", "mode": mode,
                      "argv": common + ["--save", ckpt, "--save-every", "2"]})
        cases.append({"name": f"{mode}_2p_resume", "mode": mode,
                      "argv": common + ["--resume", os.path.join(ckpt, "step_000002")]})
    return cases


# ------------------------------------------------------------------- driver


def _driver(out_dir: str) -> int:
    """Run every case of this world size through the example's main(); one process per rank."""
    from datetime import timedelta

    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import train_fsdp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank() if world > 1 else 0
    for case in _cases(world, os.path.join(out_dir, "ckpt")):
        metrics = os.path.join(out_dir, f"{case['name']}.jsonl")
        argv = TINY + ["--steps", str(STEPS), "--metrics", metrics] + case["argv"]
        if rank == 0:
            print(f"=== {case['name']}: {' '.join(argv)}", flush=True)
        try:
            train_fsdp.main(argv)
        except Exception:
            with open(os.path.join(out_dir, f"{case['name']}.rank{rank}.err"), "w") as f:
                f.write(traceback.format_exc())
            raise  # a failed collective would leave the other rank out of step
    if world > 1:
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out_dir: Path) -> list[subprocess.Popen]:
    out_dir.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if world > 1:  # what torchrun sets
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--driver", str(out_dir)],
                                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch the 1-process and 2-process drivers together; wait; return their folders."""
    base = tmp_path_factory.mktemp("example_runs")
    dirs = {1: base / "w1", 2: base / "w2"}
    procs = {w: _launch(w, d) for w, d in dirs.items()}
    for w, ps in procs.items():
        for p in ps:
            try:
                p.wait(timeout=DRIVER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return dirs


def _records(runs, world: int, name: str) -> list[dict]:
    folder = runs[world]
    errors = sorted(folder.glob(f"{name}.rank*.err"))
    if errors:
        pytest.fail(f"{name} raised:\n" + errors[0].read_text())
    path = folder / f"{name}.jsonl"
    if not path.exists():
        log = "\n".join((folder / f).read_text()[-3000:] for f in sorted(os.listdir(folder)) if f.endswith(".log"))
        pytest.fail(f"{name} did not run (an earlier case failed, or the driver died):\n{log}")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _skip_unless(mode: str) -> None:
    if MODES[mode] is not None:
        pytest.skip(MODES[mode])


# ---------------------------------------------------------------- example tests


@pytest.mark.parametrize("mode", ["none", "optimizer", "full"])
@pytest.mark.parametrize("world", [1, 2])
def test_example_trains(runs, world, mode):
    _skip_unless(mode)
    recs = _records(runs, world, f"{mode}_{world}p")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["step_time_s"] > 0 for r in recs)
    assert recs[0]["tokens_per_step"] == 4 * 32 * 2  # 4 rows x 32 tokens x 2 micro-batches
    if mode != "none":
        assert recs[-1]["offload"] is None or isinstance(recs[-1]["offload"], dict)
    log = (runs[world] / "rank0.log").read_text()
    assert f"step {STEPS}/{STEPS} | loss" in log


@pytest.mark.parametrize("mode", ["none", "optimizer", "full"])
def test_one_and_two_processes_agree(runs, mode):
    _skip_unless(mode)
    one, two = _records(runs, 1, f"{mode}_1p"), _records(runs, 2, f"{mode}_2p")
    # Same weights, same samples: only the reduction order differs.
    assert one[0]["loss"] == pytest.approx(two[0]["loss"], rel=1e-3)
    for a, b in zip(one[1:], two[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)


@pytest.mark.parametrize("mode", ["none", "optimizer", "full"])
def test_resume_continues_exactly(runs, mode):
    _skip_unless(mode)
    straight = _records(runs, 2, f"{mode}_2p")
    resumed = _records(runs, 2, f"{mode}_2p_resume")
    assert [r["step"] for r in resumed] == [STEPS]
    assert resumed[0]["lr"] == straight[-1]["lr"]
    assert resumed[0]["loss"] == straight[-1]["loss"]


def test_tied_head_without_rope(runs):
    recs = _records(runs, 1, "none_tied_norope_1p")
    assert len(recs) == STEPS and all(math.isfinite(r["loss"]) for r in recs)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_sign_sgd(runs, mode):
    if not _has_sign_sgd():
        pytest.skip("cpu_offload.SignSGD does not exist yet")
    _skip_unless(mode)
    recs = _records(runs, 1, f"{mode}_sign_sgd_1p")
    assert len(recs) == STEPS and all(math.isfinite(r["loss"]) for r in recs)


# --------------------------------------------------------- benchmark report tests


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_bench", ROOT / "benchmarks" / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["e2e_bench"] = module
    spec.loader.exec_module(module)
    return module


def _fake(mode, tokens, times, peak, wait=None, losses=None, error=None):
    if error:
        return {"mode": mode, "tokens_per_step": tokens, "error": error}
    return {"mode": mode, "tokens_per_step": tokens, "step_times_s": times, "peak_gpu_gib": peak,
            "exposed_wait_s": wait, "losses": losses or [], "n_gpus": 1, "error": None}


FAKE = [  # made-up measurements: round numbers chosen to make the arithmetic checkable
    _fake("none", 8192, [0.3, 0.1, 0.2, 0.2, 0.5], 40.0, losses=[10.0, 9.0]),
    _fake("full", 8192, [0.4, 0.4, 0.5, 0.4, 0.9], 25.0, wait=0.25, losses=[10.0, 9.5]),
    _fake("torchao", 8192, [0.8] * 5, 30.0),
    _fake("fsdp_cpu", 8192, [1.0] * 5, 20.0),
    _fake("none", 32768, [1.0] * 5, 60.0),
    _fake("full", 32768, [1.0, 1.0, 1.1, 1.0, 1.2], 45.0, wait=0.0),
    _fake("optimizer", 32768, [], None, error="exit code 1: RuntimeError: out of memory"),
]


def _row(rows, mode, tokens):
    return next(r for r in rows if r["mode"] == mode and r["tokens_per_step"] == tokens)


def test_summarize_ratios(e2e):
    rows = e2e.summarize(FAKE)
    none, full = _row(rows, "none", 8192), _row(rows, "full", 8192)
    assert none["step_s"] == pytest.approx(0.2)  # median, not mean
    assert none["ratio_to_none"] == pytest.approx(1.0) and none["gib_saved"] == pytest.approx(0.0)
    assert full["step_s"] == pytest.approx(0.4)
    assert full["ratio_to_none"] == pytest.approx(2.0)
    assert full["tokens_per_s"] == pytest.approx(8192 / 0.4)
    assert full["gib_saved"] == pytest.approx(15.0)
    assert full["exposed_wait_s"] == 0.25
    assert full["max_loss_diff_vs_none"] == pytest.approx(0.5)
    assert _row(rows, "fsdp_cpu", 8192)["gib_saved"] == pytest.approx(20.0)
    assert _row(rows, "optimizer", 32768)["error"].startswith("exit code 1")


def test_ratio_missing_without_baseline(e2e):
    rows = e2e.summarize([_fake("full", 8192, [0.4] * 5, 25.0)])
    assert "ratio_to_none" not in rows[0]
    assert " - " in e2e.format_table(rows)


def test_table_format(e2e):
    text = e2e.format_table(e2e.summarize(FAKE))
    lines = text.splitlines()
    for header in ("mode", "tokens/step", "step s", "tokens/s", "vs none", "peak GPU GiB", "GiB saved",
                   "exposed wait s"):
        assert header in lines[0]
    assert len(lines) == 2 + len(FAKE)
    full = next(line for line in lines if line.startswith("full ") and " 8192 " in line)
    assert "2.00x" in full and "0.400" in full and "20,480" in full and "15.00" in full and "0.250" in full
    assert any("torchao CPUOffloadOptimizer" in line for line in lines)
    assert any("failed: exit code 1: RuntimeError: out of memory" in line for line in lines)


def test_summary_and_targets(e2e):
    lines = e2e.summary_lines(e2e.summarize(FAKE), bandwidth_gbs=123.4)
    text = "\n".join(lines)
    assert lines[0].startswith("host memory bandwidth") and "123.4 GB/s" in lines[0]
    assert "8192 tokens/step: full 2.00x none step time, 15.00 GiB less peak GPU memory, loss within 0.5000" in text
    assert "2.00x faster than torchao CPUOffloadOptimizer" in text
    assert "2.50x faster than FSDP2 CPUOffloadPolicy" in text
    assert "target full <= 2.6x none: held (2.000x)" in text
    assert "target full <= 1.05x none: held (1.000x)" in text
    assert "target >= 11.0 GiB saved: held (15.00 GiB)" in text


def test_summary_says_slower(e2e):
    rows = e2e.summarize([_fake("none", 8192, [0.1] * 5, 40.0), _fake("full", 8192, [0.5] * 5, 20.0),
                          _fake("torchao", 8192, [0.25] * 5, 30.0)])
    text = "\n".join(e2e.summary_lines(rows))
    assert "2.00x slower than torchao CPUOffloadOptimizer" in text
    assert "target full <= 2.6x none: NOT held (5.000x)" in text
    assert "target full faster than every reference row: NOT held" in text


def test_json_and_plot(e2e, tmp_path):
    report = e2e.build_report(FAKE, bandwidth_gbs=50.0, meta={"gpu": "fake", "date": "d"})
    e2e.write_json(report, str(tmp_path / "r.json"))
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded["host_bandwidth_gbs"] == 50.0 and len(loaded["rows"]) == len(FAKE)
    report["rows"].append(e2e.summarize([_fake("none", 64, [0.1] * 5, None)])[0])  # a CPU run: no GPU peak
    made = e2e.plot(report, str(tmp_path / "r.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert made is False
    else:
        assert made and (tmp_path / "r.png").stat().st_size > 0


def test_error_line_and_skips(e2e):
    out = ["Traceback (most recent call last):\n", "[rank0]: RuntimeError: CUDA out of memory\n",
           "E1130 failed (exitcode: 1)\n", "====\n"]
    assert e2e._error_line(out) == "RuntimeError: CUDA out of memory"
    assert e2e._error_line(["just this\n"]) == "just this"
    skipped = e2e.run_config({"mode": "torchao", "tokens_per_step": 8192}, nproc=2, timeout_s=1)
    assert skipped["error"].startswith("skipped")
    table = e2e.format_table(e2e.summarize([skipped]))
    assert "skipped: torchao" in table and "failed" not in table


def test_run_config_timeout(e2e):
    cfg = e2e.configs(e2e.parse_args(["--device", "cpu", "--modes", "none", "--tokens", "2048"]))[0]
    result = e2e.run_config(cfg, nproc=1, timeout_s=0.5)  # killed while it imports torch
    assert result["error"].startswith("timed out")


def test_exposed_wait_lookup(e2e):
    assert e2e.exposed_wait(None) is None
    assert e2e.exposed_wait({"bytes_d2h": 10, "step_wait_s": 0.5}) == 0.5
    assert e2e.exposed_wait({"exposed_s": 0.1, "wait_s": 0.9}) == 0.1
    assert e2e.exposed_wait({"step_blocked_s": 0.2, "kernel_s": 0.7}) == 0.2


def test_benchmark_defaults(e2e):
    args = e2e.parse_args([])
    assert (args.d_model, args.n_layers, args.ffn_dim, args.vocab_size, args.seq_len) == (2048, 16, 5632, 32000, 2048)
    assert (args.warmup, args.steps) == (3, 5)
    plan = e2e.configs(args)
    assert [c["tokens_per_step"] for c in plan][:1] == [8192] and {c["tokens_per_step"] for c in plan} == {8192, 32768}
    assert {c["mode"] for c in plan} == set(e2e.MODES)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--driver":
    sys.exit(_driver(sys.argv[2]))
