# CPU tests of benchmarks/trace_report.py: the per-step figures of a hand-made trace, exactly;
# and a real trace of a small full-offload run (CPU_OFFLOAD_TRACE) read back by main().
import json

import pytest
import torch
from helpers import batches, build, load_benchmark, refused_by_name

from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._full.trace import ENV


@pytest.fixture(scope="module")
def report():
    return load_benchmark("trace_report.py", "trace_report_bench")


def test_the_figures_of_a_hand_made_step(report):
    w, m = "cpu_offload-worker", "MainThread"
    events = [(1.0, m, "step_end", 0),
              (1.010, w, "chunk_take", 1), (1.012, w, "kernel_begin", 1), (1.020, w, "kernel_end", 1),
              (1.021, w, "chunk_done", 1),
              (1.030, m, "forward_wait_begin", 3), (1.035, m, "forward_wait_end", 3),
              (1.040, m, "grad_staged", 0), (1.045, m, "chunk_queued", 2),
              (1.050, w, "chunk_take", 2), (1.051, w, "kernel_begin", 2), (1.090, w, "kernel_end", 2),
              (1.0995, w, "chunk_done", 2),
              (1.100, m, "step_end", 0)]
    (row,) = report.step_rows(events[::-1])  # any order: sorted by time
    want = dict(step_s=0.1, busy_s=0.011 + 0.0495, kernel_s=0.008 + 0.039, idle_s=0.010 + 0.029,
                longest_idle_s=0.029, longest_idle_at_s=0.021, forward_wait_s=0.005, first_grad_at_s=0.040,
                first_chunk_at_s=0.045, chunks=2)
    assert row == pytest.approx(want)  # the last 0.5 ms before step_end is under --gap-ms
    (row,) = report.step_rows(events, gap_s=0.0001)
    assert row["idle_s"] == pytest.approx(0.0395)


def test_a_real_trace_reads_back(report, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(ENV, str(tmp_path))
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, pinned_bytes=1 << 16, num_slots=4)
    for s in range(5):
        x, extra = batches(s, 1)[0]
        model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
    off.close()
    (trace,) = tmp_path.glob("trace_*.json")
    out = tmp_path / "report.json"
    assert report.main([str(trace), "--skip", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())[str(trace)]["steps"]
    assert len(rows) == 4  # between five step() returns
    for r in rows:  # without overlap_forward each step() drains its window: its chunks lie before it
        assert r["chunks"] >= 2 and 0 < r["kernel_s"] <= r["busy_s"] <= r["step_s"]
        assert r["busy_s"] + r["idle_s"] <= r["step_s"] + 1e-9 and r["forward_wait_s"] == 0
        assert 0 <= r["first_grad_at_s"] <= r["first_chunk_at_s"] < r["step_s"]
    assert "4 steps between step() returns, medians of the last 3" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"),
    ('{"events": [[1.0, "t", "step_end"', "not JSON"),
    ("[1, 2]", "not a pipeline trace"),
    ('{"events": [[1.0, "t"]]}', "not a pipeline trace"),
    ('{"events": [[1.0, "t", "step_begin", null], [2.0, "t", "step_end", null]]}', "fewer than two step() returns"),
])
def test_a_file_that_is_not_a_trace_is_refused_by_name(report, tmp_path, capsys, content, message):
    path = tmp_path / "trace_1.json"
    assert message in refused_by_name(report.main, [str(path)], path, content, capsys)


@pytest.mark.parametrize("flags, message", [(["--skip", "-1"], "--skip must be >= 0"),
                                            (["--gap-ms", "nan"], "--gap-ms must be >= 0"),
                                            (["--json", "/nonexistent/r.json"], "its directory does not exist")])
def test_bad_flags_are_refused_before_reading(report, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / "absent.json"), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
