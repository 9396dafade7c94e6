# CPU tests of benchmarks/capacity.py's plumbing (no GPU): a run over the tiny
# configurations with a forced out-of-memory failure (a fresh process per configuration,
# the JSON fields, "does not fit", the larger configurations not tried), the time-limit
# planner on a fake clock, the subprocess's timeout, the configuration table, and the
# meta-device materialisation it builds models with (examples/llama_model.py).
#
# The benchmark is found relative to this file; the package is the installed one.

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def capacity():
    return load_benchmark("capacity.py", "capacity_bench")


def test_tiny_run_reports_fits_and_forced_failures(capacity, tmp_path, capsys):
    out = tmp_path / "capacity.json"
    argv = ["--modes", "none,full_bf16", "--configs", "tiny", "--device", "cpu", "--tokens", "128",
            "--seq-len", "64", "--steps", "2", "--force-oom", "tiny-b", "--json", str(out)]
    assert capacity.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["mode"], r["config"]): r for r in report["rows"]}
    assert list(rows) == [(m, c) for m in ("none", "full_bf16") for c in ("tiny-a", "tiny-b", "tiny-c")]
    ran = []
    for mode in ("none", "full_bf16"):
        ok, oom, untried = rows[mode, "tiny-a"], rows[mode, "tiny-b"], rows[mode, "tiny-c"]
        assert ok["status"] == "ok" and ok["error"] is None, ok
        assert len(ok["step_times_s"]) == 2 and ok["step_s"] > 0
        assert ok["tokens_per_s"] == pytest.approx(128 / ok["step_s"])
        assert ok["peak_gpu_gib"] is None and 0 < ok["peak_host_rss_gib"] < 64  # CPU run: no GPU figure
        assert all(math.isfinite(x) for x in ok["losses"])
        assert ok["n_params"] == capacity.n_params(capacity.CONFIGS["tiny-a"])
        assert oom["status"] == "does not fit" and "MemoryError: forced by --force-oom" in oom["error"]
        assert untried["status"] == "not tried" and "tiny-b: does not fit" in untried["error"]
        ran += [ok["pid"], oom["pid"]]
        assert report["largest"][mode]["config"] == "tiny-a"
    assert len(set(ran)) == 4 and os.getpid() not in ran  # a fresh process per configuration
    assert report["meta"]["tokens_per_step"] == 128 and report["meta"]["device"] == "cpu"
    table = capsys.readouterr().out
    assert "does not fit" in table and "none: largest trained tiny-a" in table


def _fake_plan(capacity, modes, configs):
    common = {"tokens_per_step": 8192}
    return {m: [dict(common, mode=m, config=c, model=capacity.CONFIGS[c]) for c in configs] for m in modes}


def test_time_limit_is_shared_between_modes(capacity):
    now = [0.0]
    timeouts = []

    def fake_run(cfg, *, timeout_s):
        timeouts.append((cfg["mode"], cfg["config"], timeout_s))
        now[0] += 10.0 if cfg["mode"] == "none" else 40.0  # the full modes are slow
        if cfg["config"] == "8b" and cfg["mode"] == "none":
            return {"mode": cfg["mode"], "config": cfg["config"], "n_params": 1, "status": "does not fit",
                    "error": "OutOfMemoryError"}
        return {"mode": cfg["mode"], "config": cfg["config"], "n_params": capacity.n_params(cfg["model"]),
                "status": "ok"}

    plan = _fake_plan(capacity, ("none", "full"), ("1b", "3b", "8b", "14b"))
    rows = capacity.measure(plan, time_limit_s=100.0, run=fake_run, clock=lambda: now[0])
    status = [(r["mode"], r["config"], r["status"]) for r in rows]
    # none: 1b, 3b fit, 8b does not, 14b is not tried; 30 s used of its 50 s share
    assert status[:4] == [("none", "1b", "ok"), ("none", "3b", "ok"), ("none", "8b", "does not fit"),
                          ("none", "14b", "not tried")]
    assert timeouts[0] == ("none", "1b", 50.0)
    # full gets the 70 s left: 1b (40 s), 3b (started with 30 s left), then the limit
    assert timeouts[3] == ("full", "1b", 70.0) and timeouts[4] == ("full", "3b", 30.0)
    assert [r["status"] for r in rows[4:]] == ["ok", "ok", "not tried", "not tried"]
    assert "time limit" in rows[6]["error"]
    assert capacity.largest(rows) == {"none": {"config": "3b", "n_params": capacity.n_params(capacity.CONFIGS["3b"])},
                                      "full": {"config": "3b", "n_params": capacity.n_params(capacity.CONFIGS["3b"])}}


def test_a_worker_that_runs_out_of_time_is_killed_and_reported(capacity):
    cfg = _fake_plan(capacity, ("full",), ("tiny-a",))["full"][0]
    cfg.update(steps=1, seq_len=64, lr=1e-3, seed=0, device="cpu", force_oom=[])
    row = capacity.run_config(cfg, timeout_s=0.3)  # killed while it imports torch
    assert row["status"] == "timed out" and "timed out after" in row["error"]


def test_configuration_table_and_arguments(capacity):
    names = capacity.CONFIG_SETS["llama"]
    sizes = [capacity.n_params(capacity.CONFIGS[n]) / 1e9 for n in names]
    assert sizes == sorted(sizes) and 0.9 < sizes[0] < 1.1 and 22 < sizes[-1] < 23
    header = (ROOT / "benchmarks" / "capacity.py").read_text().split("\n\n", 1)[0]
    for name, size in zip(names, sizes):  # the header's table states the same counts
        assert f"{size:.2f} B" in header, name
    with pytest.raises(SystemExit):
        capacity.make_plan(capacity.parse_args(["--configs", "2b"]))
    for argv in (["--tokens", "100", "--seq-len", "64"], ["--seq-len", "0"], ["--json", "/nonexistent-dir/c.json"],
                 ["--lr", "-1"], ["--lr", "nan"],  # a bad --lr failed in each worker and the run exited 0
                 ["--stream-share", "1.5"], ["--stream-share", "nan"],
                 ["--steps", "1"]):  # its one step is the warm-up, which the step time leaves out
        with pytest.raises(SystemExit):
            capacity.parse_args(argv)
    plan = capacity.make_plan(capacity.parse_args(["--configs", "3b,1b", "--modes", "full_bf16"]))
    assert [c["config"] for c in plan["full_bf16"]] == ["1b", "3b"]  # smallest first, whatever the order given


def test_materialize_builds_from_meta_in_the_requested_dtype(capacity):
    sys.path.insert(0, str(ROOT / "examples"))
    import llama_model

    cfg = llama_model.ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=32,
                                  tie_embeddings=True)
    with torch.device("meta"):
        model = llama_model.Transformer(cfg)
    assert capacity.n_params(dict(vocab_size=512, d_model=128, n_layers=2, ffn_dim=256, tie_embeddings=True)) == \
        llama_model.count_parameters(model)
    torch.manual_seed(0)
    llama_model.materialize_(model, torch.device("cpu"), torch.bfloat16)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.requires_grad, name
        if p.dim() < 2:
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # GPT-2 style: std 0.02, the residual output projections 0.02 / sqrt(2 * n_layers)
            std = 0.01 if name.endswith(("attn.proj.weight", "mlp.down.weight")) else 0.02
            assert float(p.detach().float().std()) == pytest.approx(std, rel=0.1), name
    cos, sin = llama_model.rotary_tables(32, 32, cfg.rope_base)
    attn = model.blocks[0].attn
    assert attn.rope_cos.dtype == torch.float32 and torch.equal(attn.rope_cos, cos) and torch.equal(attn.rope_sin, sin)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)


def test_floor_mode_drops_every_gradient_and_steps_nothing(capacity):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    opt = capacity.floor_optimizer(model, lr=1.0)
    for _ in range(2):
        model(torch.randn(4, 8)).square().sum().backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.state == {} or all(not s for s in opt.state.values())


def test_profiled_floor_and_full_rows_report_efficiency(capacity, tmp_path, capsys):
    out = tmp_path / "capacity.json"
    argv = ["--modes", "floor,full", "--configs", "tiny-a", "--device", "cpu", "--tokens", "128",
            "--seq-len", "64", "--steps", "3", "--profile", "--json", str(out)]
    assert capacity.main(argv) == 0
    report = json.loads(out.read_text())
    floor, full = report["rows"]
    assert floor["mode"] == "floor" and floor["status"] == "ok" and floor["kernel_s"] is None
    assert "floor_s" not in floor and "efficiency" not in floor
    assert full["floor_s"] == floor["step_s"] and full["kernel_s"] > 0
    assert full["efficiency"] == pytest.approx(max(floor["step_s"], full["kernel_s"]) / full["step_s"])
    for row in (floor, full):
        prof = row["profile"]
        assert all(prof[k] > 0 for k in ("forward_s", "backward_s", "tail_s")), prof
        # medians of the parts against the median of their sums: close, not equal
        assert sum(prof.values()) == pytest.approx(row["step_s"], rel=0.5)
    assert full["slot_wait_s"] >= 0 and full["grad_wait_s"] >= 0 and full["step_blocked_s"] > 0
    assert report["meta"]["profile"] is True
    table = capsys.readouterr().out
    assert "profile: forward" in table and "effic." in table


@pytest.mark.parametrize("mode", ["full_bf16_auto", "full_bf16_auto_overlap"])
def test_auto_rows_time_the_steps_after_the_split_settled(capacity, tmp_path, mode):
    out = tmp_path / "capacity.json"
    argv = ["--modes", mode, "--configs", "tiny-a", "--device", "cpu", "--tokens", "128",
            "--seq-len", "64", "--steps", "2", "--json", str(out)]
    assert capacity.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and len(row["step_times_s"]) == 2 + capacity.AUTO_WINDOWS
    assert row["step_s"] == row["step_times_s"][-1]  # the median after the first of the 2 timed steps
    assert row["gpu_state_gib"] == 0  # CPU parameters: no device memory reading, nothing moves
    from cpu_offload._full.device_state import AUTO_WINDOWS
    assert capacity.AUTO_WINDOWS == AUTO_WINDOWS
