# Tests of benchmarks/plot_curves.py on made-up --metrics files (CPU only): the final
# and last-20 mean losses and their differences against the first run, checked against
# sums computed here on fresh random losses; the PNG when matplotlib is importable (and
# none when it is not); a resumed run's repeated steps; the flag errors.
#
# The script is found relative to this file.

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark, refused_by_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def curves():
    return load_benchmark("plot_curves.py", "plot_curves")


def _write(path: Path, losses: list[float], first_step: int = 1) -> Path:
    with open(path, "a") as f:  # as the example writes it: one JSON object per step, appended
        for i, loss in enumerate(losses):
            f.write(json.dumps({"step": first_step + i, "loss": loss, "lr": 1e-3, "step_time_s": 0.1}) + "\n")
    return path


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_differences_against_the_first_run(curves, tmp_path, capsys):
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    losses = {"fp32": [rng.uniform(1.0, 10.0) for _ in range(rng.randint(25, 40))],
              "bf16": [rng.uniform(1.0, 10.0) for _ in range(rng.randint(25, 40))],
              "third": [rng.uniform(1.0, 10.0) for _ in range(rng.randint(25, 40))]}
    paths = [_write(tmp_path / f"{name}.jsonl", values) for name, values in losses.items()]
    png = tmp_path / "curves.png"
    rows = curves.main(["--metrics", *map(str, paths), "--labels", *losses, "--plot", str(png)])
    out = capsys.readouterr().out

    base_final = losses["fp32"][-1]
    base_mean = sum(losses["fp32"][-20:]) / 20
    assert [r["label"] for r in rows] == list(losses)
    for row, (name, values) in zip(rows, losses.items()):
        final, mean = values[-1], sum(values[-20:]) / 20
        why = f"seed {seed}, run {name}"
        assert row["last_step"] == len(values), why
        assert row["final_loss"] == pytest.approx(final, rel=1e-12), why
        assert row["last_mean"] == pytest.approx(mean, rel=1e-12), why
        assert row["final_diff"] == pytest.approx(final - base_final, abs=1e-12), why
        assert row["final_rel"] == pytest.approx((final - base_final) / base_final, abs=1e-12), why
        assert row["mean_diff"] == pytest.approx(mean - base_mean, abs=1e-12), why
        assert row["mean_rel"] == pytest.approx((mean - base_mean) / base_mean, abs=1e-12), why
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert f"{final:.4f}" in line and f"{mean:.4f}" in line, (why, line)
        if name != "fp32":  # the first run is the reference: no differences on its line
            for diff, base in ((final - base_final, base_final), (mean - base_mean, base_mean)):
                assert f"{diff:+.4f} ({diff / base * 100:+.2f}%)" in line, (why, line)
    assert "mean last 20" in out
    if _has_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "matplotlib not importable" in out


def test_no_plot_without_matplotlib(curves, tmp_path, monkeypatch, capsys):
    a = _write(tmp_path / "a.jsonl", [2.0, 1.0])
    b = _write(tmp_path / "b.jsonl", [2.0, 1.5])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    curves.main(["--metrics", str(a), str(b), "--plot", str(tmp_path / "c.png")])
    assert "matplotlib not importable: no plot" in capsys.readouterr().out
    assert not (tmp_path / "c.png").exists()


def test_short_runs_and_default_labels(curves, tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [5.0, 4.0, 3.0])
    b = _write(tmp_path / "b.jsonl", [5.0, 4.5])
    rows = curves.main(["--metrics", str(a), str(b)])  # no --plot: nothing written
    out = capsys.readouterr().out
    assert [r["label"] for r in rows] == ["a", "b"]
    assert rows[0]["last_mean"] == pytest.approx(4.0) and rows[1]["last_mean"] == pytest.approx(4.75)
    assert rows[1]["final_diff"] == pytest.approx(1.5) and rows[1]["final_rel"] == pytest.approx(0.5)
    assert "mean last N" in out and "end at different steps" in out
    assert not list(tmp_path.glob("*.png"))


def test_resumed_run_last_record_of_a_step_wins(curves, tmp_path):
    path = _write(tmp_path / "resumed.jsonl", [6.0, 5.0, 4.0, 3.5])
    _write(path, [3.9, 3.0], first_step=4)  # resumed from the step-3 checkpoint, appended
    with pytest.warns(UserWarning, match="more than once"):
        records = curves.read_metrics(str(path))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [6.0, 5.0, 4.0, 3.9, 3.0]


def test_flag_errors(curves, tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [1.0])
    b = _write(tmp_path / "b.jsonl", [1.0])
    for argv, message in ((["--metrics", str(a)], "two or more"),
                          (["--metrics", str(a), str(b), "--labels", "x"], "one label per --metrics file: got 1 for 2"),
                          (["--metrics", str(a), str(b), "--last", "0"], "--last must be")):
        with pytest.raises(SystemExit):
            curves.main(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"),
    ('{"step": 1, "loss": 2.0}\n{"step": 2, "lo', "line 2 is not JSON"),
    ('{"step": 1}\n', "line 1: a record without 'step' and 'loss'"),
    ('[1, 2]\n', "line 1: a record without 'step' and 'loss'"),
    ('{"step": "x", "loss": 1.0}\n', "line 1: a record whose 'step' is not a whole number"),
    ('{"step": 1, "loss": "x"}\n', "line 1: a record whose 'loss' is not a number"),
    ("\n", "no step records"),
])
def test_a_metrics_file_that_cannot_be_read_is_refused_by_name(curves, tmp_path, capsys, content, message):
    a, bad = _write(tmp_path / "a.jsonl", [1.0]), tmp_path / "bad.jsonl"
    assert message in refused_by_name(curves.main, ["--metrics", str(a), str(bad)], bad, content, capsys)
