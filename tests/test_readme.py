# Every fenced ```python and ```bash block of the user's manual (README.md, docs/frameworks.md,
# docs/kernels.md), run as written, so the manual cannot drift from the code.
#
# Scope: each python block runs alone in a fresh interpreter (the blocks are self-contained),
# in a temporary directory; each bash block runs in the repository root. A block is not run
# only when the README says so right above its fence with `<!-- not run: <reason> -->` (a GPU,
# several processes, minutes), when it installs packages, or when a framework it imports is
# not installed; every such skip is reported with its reason.
# NOTE: the quickstart block is marked: tests/test_examples.py runs it as examples/quickstart.py
# and checks that the two are the same code.

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The user's manual: the README and the pages it moved its recipes to (the other docs/ pages
# explain mechanisms, with fragments that are not programs).
MANUALS = [README, ROOT / "docs" / "frameworks.md", ROOT / "docs" / "kernels.md"]
TIMEOUT_S = 180
FRAMEWORKS = ("transformers", "accelerate", "lightning", "trl", "peft", "datasets")
_FENCE = re.compile(r"(?:<!-- not run: (?P<why>.+?) -->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)


def readme_blocks() -> list[dict]:
    """Each python/bash block of the manuals: language, code, file and line, and why it is not run."""
    blocks = []
    for path in MANUALS:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            blocks.append(dict(lang=m["lang"], code=m["code"], file=path.name, line=line, why=m["why"]))
    return blocks


def _skip_reason(block: dict) -> str | None:
    if block["why"]:
        return f"README marks it not run: {block['why']}"
    if block["lang"] == "bash" and re.search(r"\bpip install\b", block["code"]):
        return "installs packages (CI installs the package the same way before the tests)"
    if block["lang"] == "python":
        imported = set(re.findall(r"^\s*(?:import|from) (\w+)", block["code"], flags=re.M))
        missing = [name for name in FRAMEWORKS if name in imported and importlib.util.find_spec(name) is None]
        if missing:
            return f"needs {', '.join(missing)} (pip install -e \".[frameworks]\")"
    return None


BLOCKS = readme_blocks()


def test_readme_has_blocks_and_every_marker_sits_on_a_fence():
    assert len(BLOCKS) >= 10
    for path in MANUALS:  # no stray markers
        marked = sum(1 for b in BLOCKS if b["why"] and b["file"] == path.name)
        assert path.read_text().count("<!-- not run:") == marked, path.name


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b['file']}-{b['lang']}-line{b['line']}" for b in BLOCKS])
def test_readme_block_runs(block, tmp_path):
    why = _skip_reason(block)
    if why:
        pytest.skip(why)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if block["lang"] == "python":
        cmd, cwd = [sys.executable, "-c", block["code"]], tmp_path
        env["PYTHONWARNINGS"] = "ignore"
    else:
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", block["code"]], ROOT
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"README.md line {block['line']} failed:\n{block['code']}\n"
                                  f"--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-4000:]}")
