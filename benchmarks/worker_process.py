# Running one benchmark configuration in a fresh process: its output is echoed
# line by line, one tagged line carries its JSON result, and a timeout kills its
# whole process group (torchrun's workers too), as does a Ctrl-C or SIGTERM of the caller.
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


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_worker(cmd: list, *, env: dict, timeout_s: float, tag: str, tail_lines: int) -> WorkerRun:
    """Run ``cmd`` in a session of its own, echo its output, return its tagged result.

    NOTE: the worker's session keeps a terminal's Ctrl-C from reaching it, so a Ctrl-C or a
    SIGTERM (taken as an exit here) that stops this process kills the worker's group first."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
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
        if proc.poll() is None:  # stopped before the worker ended
            _kill_group(proc)
            proc.wait()
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return WorkerRun(result, tail, proc.returncode, timed_out.is_set())
