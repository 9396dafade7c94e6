# Argument checks shared by the benchmark scripts' command lines.
#
# Scope: the output files (--json, --plot), the JSON files a report reads, counts with a
# lower bound. Stays free of torch and cpu_offload imports, so that a driver script which only
# starts workers stays light. Non-goals: checks of one script only (they stay beside it).

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Callable, Optional

__all__ = ["check_output_paths", "check_at_least", "whole_count", "read_json"]


def check_output_paths(parser: argparse.ArgumentParser, *options: tuple) -> None:
    """``parser.error()`` (exit 2) for the first ``(option, path)`` whose path is given and is
    a directory, or whose directory does not exist. NOTE: called before the run, which a bad
    path would otherwise lose at its end."""
    for option, path in options:
        if path and os.path.isdir(path):
            parser.error(f"{option} {path}: is a directory; name the file to write")
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{option} {path}: its directory does not exist")
        if path and (why := unwritable(path)):
            parser.error(f"{option} {path}: cannot be written ({why})")


def unwritable(path: str):
    """Why ``path`` cannot be written, or None: a file there is opened for appending (which
    changes nothing), else a temporary file is made and removed beside it."""
    try:
        if os.path.exists(path):
            with open(path, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path))):
                pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_at_least(parser: argparse.ArgumentParser, option: str, value, low: int = 1) -> None:
    """``parser.error()`` (exit 2) unless ``value`` >= ``low``."""
    if not value >= low:
        parser.error(f"{option} must be >= {low}, got {value}")


def whole_count(parser: argparse.ArgumentParser, option: str, value: float) -> int:
    """``value`` (read as a float, so that 2.7e8 is accepted) as an int, or ``parser.error()``
    (exit 2) unless it is a whole number >= 1."""
    if not (1 <= value < float("inf") and value == int(value)):
        parser.error(f"{option} must be a whole number >= 1, got {value}")
    return int(value)


def read_json(parser: argparse.ArgumentParser, path, why_not: Callable[[object], Optional[str]]):
    """The JSON value in ``path``; ``parser.error()`` (exit 2) naming the file when it cannot be
    read, is not JSON, or ``why_not(value)`` says why it is not what the script reads."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        parser.error(f"{path}: cannot be read ({e.strerror or type(e).__name__})")
    except ValueError as e:  # also a UnicodeDecodeError
        parser.error(f"{path}: not JSON ({e})")
    if (why := why_not(value)) is not None:
        parser.error(f"{path}: {why}")
    return value
