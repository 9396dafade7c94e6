# Tests of benchmarks/e2e.py that need no GPU: its report code (table, ratios, summary
# against the targets, JSON, plot) on fake measurements, the configuration plan, the
# subprocess error handling, and a run in which no configuration ran.
#
# The benchmark is found relative to this file; the package is the installed one.

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import cpu_offload
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    return load_benchmark("e2e.py", "e2e_bench")


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


def test_exposed_wait_reads_what_full_offload_reports(e2e):
    model = torch.nn.Linear(8, 4)
    opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full", pinned_bytes=1 << 16)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    stats = opt.stats()
    opt.close()
    assert e2e.exposed_wait(stats) == stats["step_blocked_s"]
    assert e2e.exposed_wait(None) is None  # optimizers without stats()


def test_configs_plan_and_checks(e2e):
    args = e2e.parse_args(["--modes", "full,none", "--tokens", "4096,2048", "--seq-len", "1024"])
    plan = [(c["mode"], c["tokens_per_step"]) for c in e2e.configs(args)]
    assert plan == [("full", 4096), ("none", 4096), ("full", 2048), ("none", 2048)]  # budgets outer
    with pytest.raises(SystemExit, match="not a multiple of seq_len x GPUs = 2048"):
        e2e.configs(e2e.parse_args(["--tokens", "3072", "--seq-len", "1024", "--nproc-per-node", "2"]))
    with pytest.raises(SystemExit, match="unknown modes"):
        e2e.configs(e2e.parse_args(["--modes", "fulll"]))


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "8k"], ["--tokens", ","], ["--warmup", "-1"],
                                  ["--seq-len", "0"], ["--n-layers", "0"], ["--nproc-per-node", "0"],
                                  ["--timeout", "0"], ["--timeout", "inf"], ["--d-model", "64", "--n-heads", "3"],
                                  ["--modes", ","], ["--json", "/nonexistent-dir/e2e.json"],
                                  ["--stream-share", "1.5"], ["--stream-share", "-0.1"], ["--stream-share", "nan"]])
def test_bad_arguments_stop_before_any_run(e2e, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.parse_args(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err.split("error:", 1)[1]


def test_device_cuda_without_cuda_stops_before_any_run(e2e, monkeypatch, capsys):
    """``--device cuda`` without CUDA ran the host's bandwidth probe, then failed in each
    configuration's worker with torch's internal error."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        e2e.parse_args(["--device", "cuda"])
    assert exit_.value.code == 2 and "--device cuda: torch.cuda.is_available() is False" in capsys.readouterr().err


def test_no_configuration_ran(e2e, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "host_bandwidth_gbs", lambda: (1.0, "fake"))
    png, out = tmp_path / "e2e.png", tmp_path / "e2e.json"
    # torchao on 2 GPUs is skipped without starting a process
    rc = e2e.main(["--modes", "torchao", "--nproc-per-node", "2", "--tokens", "4096", "--plot", str(png),
                   "--json", str(out)])
    assert rc == 1
    assert "no configuration ran (1 tried, each failed or was skipped" in capsys.readouterr().err
    assert not png.exists() and json.loads(out.read_text())["rows"][0]["error"].startswith("skipped")
    report = e2e.build_report([{"mode": "full", "tokens_per_step": 8, "error": "exit code 1"}], bandwidth_gbs=None,
                              meta={})
    with pytest.raises(ValueError, match="no configuration ran"):
        e2e.plot(report, str(png))


@pytest.mark.parametrize("losses", [[10.0, float("nan"), float("nan")], [float("nan"), 9.0, 8.0],
                                    [10.0, 9.0, float("inf")]])
def test_a_loss_that_went_non_finite_is_reported_as_diverged(e2e, losses):
    """max() over differences with a NaN among them depends on where the NaN falls: a run whose
    loss went NaN after its first step read "loss within 0.0000 of none"."""
    rows = e2e.summarize([_fake("none", 8192, [0.1] * 5, 40.0, losses=[10.0, 9.0, 8.0]),
                          _fake("full", 8192, [0.2] * 5, 20.0, losses=losses)])
    assert math.isnan(_row(rows, "full", 8192)["max_loss_diff_vs_none"])
    text = "\n".join(e2e.summary_lines(rows))
    assert "loss not finite where none's is (diverged)" in text and "loss within" not in text


def test_a_baseline_that_diverged_does_not_make_full_read_as_diverged(e2e):
    rows = e2e.summarize([_fake("none", 8192, [0.1] * 5, 40.0, losses=[10.0, float("nan"), float("nan")]),
                          _fake("full", 8192, [0.2] * 5, 20.0, losses=[10.5, 9.0, 8.0])])
    assert _row(rows, "full", 8192)["max_loss_diff_vs_none"] == pytest.approx(0.5)  # the steps both ran finite
    rows = e2e.summarize([_fake("none", 8192, [0.1] * 5, 40.0, losses=[float("nan")] * 2),
                          _fake("full", 8192, [0.2] * 5, 20.0, losses=[float("nan")] * 2)])
    assert _row(rows, "full", 8192)["max_loss_diff_vs_none"] is None
    assert "diverged" not in "\n".join(e2e.summary_lines(rows))


def test_equal_times_are_not_called_faster(e2e):
    rows = e2e.summarize([_fake("none", 8192, [0.1] * 5, 40.0), _fake("full", 8192, [0.5] * 5, 20.0),
                          _fake("fsdp_cpu", 8192, [0.5] * 5, 30.0)])
    text = "\n".join(e2e.summary_lines(rows))
    assert "as fast as FSDP2 CPUOffloadPolicy" in text and "faster than FSDP2" not in text
    assert "target full faster than every reference row: NOT held" in text
