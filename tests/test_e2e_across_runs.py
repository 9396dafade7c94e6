# CPU test of benchmarks/e2e_across_runs.py on fake e2e files: ratios to each file's own
# `none` step, arms of a dict of reports, files without a `none` row or a kernel time skipped.
import json

import pytest
from helpers import load_benchmark


def _row(mode, steps, kernel=None):
    return {"mode": mode, "step_times_s": steps, "offload_stats": None if kernel is None else {"kernel_s": kernel}}


def test_ratios_and_summary_across_files(tmp_path, capsys):
    bench = load_benchmark("e2e_across_runs.py", "e2e_across_runs_bench")
    a = tmp_path / "a.json"  # one report
    a.write_text(json.dumps({"results": [_row("none", [0.1, 0.2, 0.1]), _row("full_overlap", [0.3, 0.2, 0.2], 0.15),
                                         _row("full_bf16_overlap", [0.5], None)]}))
    b = tmp_path / "b.json"  # two arms; the none step is the median over the arms
    b.write_text(json.dumps({"x": {"results": [_row("none", [0.2]), _row("full_overlap", [0.5], 0.4)]},
                             "y": {"results": [_row("none", [0.4]), _row("full_overlap", [0.6], 0.3)]}}))
    c = tmp_path / "c.json"  # no none row: skipped
    c.write_text(json.dumps({"results": [_row("full_overlap", [9.0], 9.0)]}))
    modes = {"full_overlap", "full_bf16_overlap"}
    assert bench.ratios(a, modes) == [("full_overlap", pytest.approx(2.0), pytest.approx(1.5), pytest.approx(0.05))]
    assert bench.ratios(b, modes) == [("full_overlap", pytest.approx(5 / 3), pytest.approx(4 / 3), pytest.approx(0.1)),
                                      ("full_overlap", pytest.approx(2.0), pytest.approx(1.0), pytest.approx(0.3))]
    assert bench.ratios(c, modes) == []
    s = bench.summary(bench.ratios(a, modes) + bench.ratios(b, modes))["full_overlap"]
    assert s["runs"] == 3
    assert s["step_x_none"] == pytest.approx((5 / 3, 2.0, 2.0))
    assert s["kernel_x_none"] == pytest.approx((1.0, 4 / 3, 1.5))
    assert bench.main([str(a), str(b), str(c)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 files") and "full_overlap: 3 runs" in out
