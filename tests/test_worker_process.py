# benchmarks/worker_process.py: a configuration's worker runs in a session of its own, so a
# Ctrl-C or a SIGTERM that stops the benchmark must take the worker (and its group) with it.
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import sys
sys.path.insert(0, {benchmarks!r})
from worker_process import run_worker
child = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]
run_worker(child, env=None, timeout_s=300, tag="@@", tail_lines=5)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_benchmark_takes_its_worker_with_it(sig):
    """A Ctrl-C or a SIGTERM (what ``timeout`` sends) stopped e2e.py or capacity.py and left the
    worker running, orphaned, holding its memory (on a GPU host, the GPU's) for minutes."""
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(benchmarks=benchmarks)], text=True,
                              stdout=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        if "child" in locals() and _alive(child):
            os.killpg(child, signal.SIGKILL)
