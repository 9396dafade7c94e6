# A timeline of full offload's pipeline, for finding where a step's time goes: which chunk
# the worker ran when, how long its kernel took, when backward staged gradients, when a
# forward waited for weights. Off unless the environment variable CPU_OFFLOAD_TRACE names a
# directory; each optimizer then writes trace_<pid>_<n>.json there when it is closed.
# benchmarks/trace_report.py turns a file into per-step figures.
#
# Scope: recording events and writing them. Non-goals: analysis (benchmarks/trace_report.py),
# GPU timestamps (the events are host times; a copy's completion is seen when the worker
# finds it done).

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["ENV", "Trace", "NO_TRACE", "trace_from_env"]

ENV = "CPU_OFFLOAD_TRACE"
_numbers = itertools.count()


class Trace:
    """Events as ``(seconds of time.perf_counter, thread name, event, value)``; ``path`` None:
    off, ``mark`` does nothing.
    NOTE: ``list.append`` is atomic under the GIL, so the worker and the training thread
    mark without a lock."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        self.events: list = []

    def mark(self, event: str, value: int = 0, at: Optional[float] = None) -> None:
        if self.path is not None:
            self.events.append((time.perf_counter() if at is None else at, threading.current_thread().name,
                                event, value))

    def write(self) -> None:
        """Write the events once (later calls do nothing); a failure warns, naming the file."""
        path, self.path = self.path, None
        if path is None:
            return
        try:
            path.write_text(json.dumps({"clock": "time.perf_counter seconds", "pid": os.getpid(),
                                        "events": self.events}))
        except OSError as e:
            warnings.warn(f"cpu_offload: could not write the pipeline trace to {path}: {e}", RuntimeWarning,
                          stacklevel=2)


NO_TRACE = Trace(None)


def trace_from_env() -> Trace:
    """A Trace writing to the directory that CPU_OFFLOAD_TRACE names, or NO_TRACE when it is
    unset or empty; ValueError when it names no directory."""
    raw = os.environ.get(ENV, "")
    if not raw:
        return NO_TRACE
    directory = Path(raw)
    if not directory.is_dir():
        raise ValueError(f"{ENV}={raw!r} is not a directory: set it to an existing directory for the "
                         f"pipeline trace files, or unset it")
    return Trace(directory / f"trace_{os.getpid()}_{next(_numbers)}.json")
