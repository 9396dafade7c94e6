# CPU test of benchmarks/kernel_calls.py: a small run checks every slot size against the
# reference, times them and writes one row per (moments, slot size), the smallest slots with
# the cost of one more call.
import json

import pytest
from helpers import load_benchmark

from cpu_offload import kernels


@pytest.fixture
def restore_threads():
    before = kernels.get_num_threads()
    yield
    kernels.set_num_threads(before)


def test_small_run_writes_every_slot_size_for_both_moment_dtypes(tmp_path, restore_threads):
    bench = load_benchmark("kernel_calls.py", "kernel_calls_bench")
    out = tmp_path / "calls.json"
    assert bench.main(["--numel", "2e6", "--slots-mib", "2,1", "--repeats", "2", "--threads", "1",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["moments"], r["slot_mib"], r["calls"]) for r in rows] == [
        (m, mib, calls) for m in ("float32", "bfloat16") for mib, calls in ((2, 2), (1, 4))]
    for big, small in zip(rows[::2], rows[1::2]):
        assert big["ms"] > 0 and small["gb_s"] > 0 and "ms_per_extra_call" not in big
        assert small["ms_per_extra_call"] == (small["ms"] - big["ms"]) / 2
    assert report["threads"] == 1 and report["numel"] == 2_000_000


@pytest.mark.parametrize("bad", ["0", "64,x", ""])
def test_bad_slot_sizes_are_refused_naming_the_option(capsys, bad):
    bench = load_benchmark("kernel_calls.py", "kernel_calls_bench")
    with pytest.raises(SystemExit):
        bench.main(["--slots-mib", bad])
    assert "--slots-mib must list positive sizes" in capsys.readouterr().err
