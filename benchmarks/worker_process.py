# Running one benchmark configuration in a fresh process: its output is echoed
# line by line, one tagged line carries its JSON result, and a timeout kills its
# whole process group (torchrun's workers too).
#
# Scope: the subprocess mechanics shared by e2e.py and capacity.py. Non-goals:
# what a configuration runs, how a missing result is reported.

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Optional

__all__ = ["WorkerRun", "run_worker"]


@dataclass
class WorkerRun:
    result: Optional[dict]  # the tagged JSON line, when the worker printed one
    tail: list  # its last output lines
    returncode: int
    timed_out: bool


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass


def run_worker(cmd: list, *, env: dict, timeout_s: float, tag: str, tail_lines: int) -> WorkerRun:
    """Run ``cmd`` in a session of its own, echo its output, return its tagged result."""
    proc = subprocess.Popen(cmd, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timed_out = threading.Event()
    timer = threading.Timer(max(timeout_s, 0.0), lambda: (timed_out.set(), _kill_group(proc)))
    timer.start()
    tail, result = [], None
    try:
        for line in proc.stdout:
            if line.startswith(tag):
                result = json.loads(line[len(tag):])
                continue
            print(line, end="", flush=True)
            tail = (tail + [line])[-tail_lines:]
        proc.wait()
    finally:
        timer.cancel()
    return WorkerRun(result, tail, proc.returncode, timed_out.is_set())
