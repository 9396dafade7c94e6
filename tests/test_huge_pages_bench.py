# CPU test of benchmarks/huge_pages.py: a small run checks both arms against the reference,
# times them and writes one row per (moments, arm) with the ratio on the huge-page row.
import json

from helpers import load_benchmark


def test_small_run_writes_both_arms_for_both_moment_dtypes(tmp_path):
    bench = load_benchmark("huge_pages.py", "huge_pages_bench")
    out = tmp_path / "hp.json"
    assert bench.main(["--numel", "70000", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["moments"], r["arm"]) for r in report["rows"]] == [
        (m, a) for m in ("float32", "bfloat16") for a in ("huge pages", "ordinary pages")]
    for huge, ordinary in zip(report["rows"][::2], report["rows"][1::2]):
        assert huge["x_ordinary"] == ordinary["ms"] / huge["ms"] and huge["ms"] > 0 and ordinary["gb_s"] > 0
        assert isinstance(huge["process_anon_huge_kib"], int)
    assert report["thp"] and report["threads"] >= 1
