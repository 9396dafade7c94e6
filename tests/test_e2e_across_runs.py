# CPU test of benchmarks/e2e_across_runs.py on fake e2e files: ratios to each file's own
# `none` step, arms of a dict of reports, files without a `none` row or a kernel time skipped,
# the step against the host's floor where the probe and the model's size are known.
import json

import pytest
from helpers import load_benchmark, refused_by_name


def _read(path):
    return json.loads(path.read_text())


def _row(mode, steps, kernel=None, n_params=None):
    return {"mode": mode, "step_times_s": steps, "offload_stats": None if kernel is None else {"kernel_s": kernel},
            "n_params": n_params}


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
    assert bench.ratios(_read(a), modes) == [("full_overlap", pytest.approx(2.0), pytest.approx(1.5), pytest.approx(0.05), None)]
    assert bench.ratios(_read(b), modes) == [
        ("full_overlap", pytest.approx(5 / 3), pytest.approx(4 / 3), pytest.approx(0.1), None),
        ("full_overlap", pytest.approx(2.0), pytest.approx(1.0), pytest.approx(0.3), None)]
    assert bench.ratios(_read(c), modes) == []
    s = bench.summary(bench.ratios(_read(a), modes) + bench.ratios(_read(b), modes))["full_overlap"]
    assert s["runs"] == 3 and s["host_floor_runs"] == 0 and "step_x_host_floor" not in s
    assert s["step_x_none"] == pytest.approx((5 / 3, 2.0, 2.0))
    assert s["kernel_x_none"] == pytest.approx((1.0, 4 / 3, 1.5))
    assert bench.main([str(a), str(b), str(c)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 files") and "full_overlap: 3 runs" in out


def test_the_step_against_the_floor_of_the_hosts_probe(tmp_path, capsys):
    bench = load_benchmark("e2e_across_runs.py", "e2e_across_runs_bench")
    # 1e9 parameters on a 100 GB/s host: 28 B each take 0.28 s with fp32 moments, 20 B 0.2 s with
    # bf16 ones; with a 0.04 s forward the floors are 0.32 and 0.24 s.
    f = tmp_path / "probed.json"
    f.write_text(json.dumps({"host_bandwidth_gbs": 100.0, "results": [
        _row("none", [0.2]), _row("full_overlap", [0.352], 0.3, n_params=10**9),
        _row("full_bf16_overlap", [0.3], 0.25, n_params=10**9)]}))
    modes = {"full_overlap", "full_bf16_overlap"}
    got = {mode: floor for mode, *_, floor in bench.ratios(_read(f), modes)}
    assert got == {"full_overlap": pytest.approx(1.1), "full_bf16_overlap": pytest.approx(1.25)}
    assert {mode: floor for mode, *_, floor in bench.ratios(_read(f), modes, forward_s=0.0)} == {
        "full_overlap": pytest.approx(0.352 / 0.28), "full_bf16_overlap": pytest.approx(1.5)}
    s = bench.summary(bench.ratios(_read(f), modes))
    assert s["full_bf16_overlap"]["host_floor_runs"] == 1
    assert s["full_bf16_overlap"]["step_x_host_floor"] == pytest.approx((1.25, 1.25, 1.25))
    assert bench.main([str(f)]) == 0
    assert "step_x_host_floor 1.100 / 1.100 / 1.100" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"),
    ('{"results": [', "not JSON"),
    ("[1, 2]", "not an e2e report"),
    ('{"results": [1]}', "not an e2e report"),
])
def test_a_file_that_is_not_an_e2e_report_is_refused_by_name(tmp_path, capsys, content, message):
    bench = load_benchmark("e2e_across_runs.py", "e2e_across_runs_bench")
    path = tmp_path / "run.json"
    assert message in refused_by_name(bench.main, [str(path)], path, content, capsys)


def test_reports_nested_one_level_deeper_are_read(tmp_path, capsys):
    """Files that keep their arms under "runs" or "arms" beside their commands (kept results of
    arm comparisons) were refused, so the glob the profile gives exited 2."""
    bench = load_benchmark("e2e_across_runs.py", "e2e_across_runs_bench")
    f = tmp_path / "arms.json"
    f.write_text(json.dumps({"source": "x", "arms": {"a": "command a", "b": "command b"}, "runs": {
        "a": {"results": [_row("none", [0.2]), _row("full_overlap", [0.4], 0.3)]},
        "b": {"results": [_row("none", [0.2]), _row("full_overlap", [0.5], 0.3)]}}}))
    assert bench.ratios(_read(f), {"full_overlap"}) == [
        ("full_overlap", pytest.approx(2.0), pytest.approx(1.5), pytest.approx(0.1), None),
        ("full_overlap", pytest.approx(2.5), pytest.approx(1.5), pytest.approx(0.2), None)]
    assert bench.main([str(f)]) == 0
    assert "full_overlap: 2 runs" in capsys.readouterr().out
