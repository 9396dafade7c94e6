# The benchmark scripts that time kernels stop at a bad argument with a usage error naming it,
# before any run (a missing --json directory, a --json that is a directory or cannot be
# written, used to fail after the whole run, losing it; a --numel beyond the host's RAM
# reached the allocator).
import pytest
from helpers import load_benchmark

from cpu_offload import kernels

BAD = {
    "kernel_calls.py": [["--numel", "0"], ["--numel", "-5"], ["--numel", "nan"], ["--numel", "inf"], ["--numel", "0.5"],
                        ["--numel", "1e15"], ["--repeats", "0"], ["--threads", "0"],
                        ["--threads", "100000"], ["--json", "/nonexistent-dir/k.json"], ["--json", "/proc/k.json"]],
    "huge_pages.py": [["--numel", "0"], ["--numel", "nan"], ["--numel", "1.5"], ["--numel", "1e15"], ["--repeats", "0"],
                      ["--json", "/nonexistent-dir/h.json"],
                      ["--json", "/proc/h.json"]],
    "device_step.py": [["--numel", "0"], ["--repeats", "0"], ["--json", "/nonexistent-dir/d.json"],
                       ["--json", "/proc/d.json"]],
    "host_stream.py": [["--numel", "0"], ["--numel", "nan"], ["--numel", "1000"], ["--numel", "1e15"],
                       ["--repeats", "0"], ["--shares", "x"], ["--shares", "0,1.5"], ["--shares", "0.5"],
                       ["--shares", "0,-0.1"], ["--json", "/nonexistent-dir/s.json"], ["--json", "/proc/s.json"]],
}


def _stops_before_any_run(script, argv, capsys, monkeypatch):
    bench = load_benchmark(script, script.removesuffix(".py") + "_arguments")
    threads = kernels.get_num_threads()
    monkeypatch.setattr(bench, "rows_for", lambda *a, **k: pytest.fail("the run started"), raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and argv[0] in err.split("error:", 1)[1]
    assert kernels.get_num_threads() == threads
    return err


@pytest.mark.parametrize("script,argv", [(script, argv) for script, cases in BAD.items() for argv in cases])
def test_bad_arguments_stop_before_any_run(script, argv, capsys, monkeypatch):
    _stops_before_any_run(script, argv, capsys, monkeypatch)


@pytest.mark.parametrize("script", list(BAD))
def test_a_json_path_that_is_a_directory_stops_before_any_run(script, tmp_path, capsys, monkeypatch):
    err = _stops_before_any_run(script, ["--json", str(tmp_path)], capsys, monkeypatch)
    assert f"--json {tmp_path}: is a directory" in err


@pytest.mark.parametrize("script,argv", [("device_step.py", ["--numel", "1024"]),
                                         ("host_stream.py", ["--numel", str(1 << 25)])])
def test_a_benchmark_of_the_device_without_cuda_says_so(script, argv, capsys, monkeypatch):
    bench = load_benchmark(script, script.removesuffix(".py") + "_arguments")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
