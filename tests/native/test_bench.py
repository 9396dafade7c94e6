# The micro-benchmark CLI: checks every ISA against the reference, times every
# configuration, writes the table and JSON; bad options are argparse errors.
import json

import pytest
import torch

from cpu_offload import bench, kernels


def test_bench_runs_every_isa_and_configuration(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--numel", "100003", "--tensors", "7", "--repeats", "1", "--threads", "2",
                       "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    rows = result["rows"]
    timed = {(r["isa"], r["config"]) for r in rows if r["isa"] not in ("torch", "deepspeed")}
    assert timed == {(isa, config) for isa in kernels.available_isas() for config in bench.CONFIGS}
    assert rows[0]["isa"] == "torch"
    for r in rows:
        assert r["ms"] > 0 and r["gb_s"] > 0 and r["probe_share"] > 0 and r["vs_torch_fused"] > 0
        # bf16-state rows carry their elements/s over the fp32-state configuration's
        if r["config"] in bench.FP32_STATES_OF:
            assert r["vs_fp32_states"] > 0
            assert r["gb_s"] == pytest.approx(bench.CONFIGS[r["config"]] * r["gelem_s"])
        else:
            assert r["vs_fp32_states"] is None
    assert bench.CONFIGS["adamw bf16 states->bf16"] == 20
    assert result["meta"]["threads"] == 2 and result["meta"]["tensors"] == 7
    out = capsys.readouterr().out
    assert "x torch fused" in out and "adamw bf16 grads->bf16" in out
    assert "x fp32 states" in out and "adamw bf16 states->bf16" in out
    last = out.strip().splitlines()[-1]  # the verdict closes the output
    assert last.startswith("verdict: kernels bit-exact against the reference: yes")
    assert f"{kernels.isa()} (the ISA dispatch picks)" in last and "% of the measured memory bandwidth" in last


def test_reference_check_catches_a_wrong_kernel(monkeypatch):
    for isa in kernels.available_isas():
        bench.check_against_reference(isa)
    real = kernels.sign_sgd_step
    monkeypatch.setattr(kernels, "sign_sgd_step", lambda p, g, **kw: real(p, g, **dict(kw, lr=kw["lr"] * 2)))
    with pytest.raises(AssertionError, match="differ from cpu_offload.reference"):
        bench.check_against_reference("scalar")
    monkeypatch.setattr(kernels, "sign_sgd_step", real)
    real_adamw = kernels.adamw_step

    def off_by_one_bit_in_bf16_moments(p, g, m, v, steps, **kw):
        real_adamw(p, g, m, v, steps, **kw)
        if m[0].dtype == torch.bfloat16:
            m[0].view(torch.int16)[:1].bitwise_xor_(1)

    monkeypatch.setattr(kernels, "adamw_step", off_by_one_bit_in_bf16_moments)
    with pytest.raises(AssertionError, match="differ from cpu_offload.reference"):
        bench.check_against_reference("scalar")


@pytest.mark.parametrize("argv", [["--numel", "0"], ["--tensors", "10", "--numel", "5"], ["--repeats", "0"],
                                  ["--threads", "0"], ["--threads", "100000"], ["--isa", "neon"],
                                  ["--json", "/nonexistent-dir/bench.json"], ["--json", ""],
                                  ["--numel", "3000000", "--tensors", "3000000"]])
def test_bench_rejects_bad_options(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2



def test_bench_refuses_a_json_path_that_is_a_directory_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "check_against_reference", lambda isa: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--numel", "4099", "--repeats", "1", "--isa", "scalar", "--json", str(tmp_path)])
    assert e.value.code == 2 and f"--json {tmp_path}: is a directory" in capsys.readouterr().err


def test_bench_refuses_a_json_path_it_cannot_write_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "check_against_reference", lambda isa: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--numel", "4099", "--repeats", "1", "--isa", "scalar", "--json", "/proc/bench.json"])
    assert e.value.code == 2 and "--json /proc/bench.json: cannot be written" in capsys.readouterr().err
    monkeypatch.undo()
    bench.main(["--numel", "4099", "--repeats", "1", "--isa", "scalar", "--json", str(tmp_path / "b.json")])
    assert (tmp_path / "b.json").stat().st_size > 0  # a writable path is written, after the run


def test_verdict_names_the_isa_it_reports_when_isa_leaves_out_the_dispatched_one(capsys):
    dispatched = kernels.isa()
    others = [isa for isa in kernels.available_isas() if isa != dispatched]
    if not others:
        pytest.skip(f"this CPU runs only {dispatched}: no other ISA to time")
    argv = ["--numel", "4099", "--repeats", "1"]
    for isa in reversed(others[-2:]):   # the widest last given first
        argv += ["--isa", isa]
    assert bench.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{others[-1]} (the widest ISA timed; dispatch picks {dispatched}) runs adamw bf16 grads->bf16" in last
    assert "(the ISA dispatch picks)" not in last

def test_deepspeed_row_only_when_asked_for(monkeypatch, capsys):
    import importlib.util

    small = ["--numel", "4099", "--repeats", "1", "--isa", "scalar"]
    assert bench.main(small) == 0
    captured = capsys.readouterr()
    assert "deepspeed" not in (captured.out + captured.err).lower()  # not asked: silent
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed"
                        else real_find_spec(name, *a))
    assert bench.main(small + ["--deepspeed"]) == 0
    captured = capsys.readouterr()
    assert "--deepspeed: DeepSpeed is not installed" in captured.err and "deepspeed" not in captured.out


def test_help_explains_columns_and_timing(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for column in ("isa", "configuration", "ms", "GB/s", "Gelem/s", "of probe", "x torch fused", "x fp32 states"):
        assert f"\n  {column} " in text, column
    assert "median time of one call over --repeats timed calls (default 7)" in text
    assert "above 100% is possible" in text and "``" not in text


def test_bench_refuses_a_numel_beyond_available_memory(monkeypatch, capsys):
    # Checked before anything is allocated: a usage error, not the allocator's traceback.
    with pytest.raises(SystemExit) as e:
        bench.main(["--numel", "99999999999999999"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--numel 99999999999999999 needs about" in err and "available" in err
    # the bandwidth probe (at least 128M floats) counts too, also for a small workload
    assert bench.bytes_needed(4099) >= 4 << 27
    monkeypatch.setattr(bench, "available_bytes", lambda: 256 << 20)
    with pytest.raises(SystemExit) as e:
        bench.main(["--numel", "4099"])
    assert e.value.code == 2 and "--numel 4099 needs about 0.5 GiB" in capsys.readouterr().err


def test_the_torch_reference_is_torch_adamw_and_every_timed_call_keeps_the_workload_finite():
    """The torch row is one step of torch.optim.AdamW(fused=True) (whose step counts rise before the
    op: at 0 its bias correction divides by zero), and no timed call leaves NaN for the next one."""
    work = bench.Workload(4099, 3)
    params = [torch.nn.Parameter(p.clone()) for p in work.params]
    for p, g in zip(params, work.grads):
        p.grad = g.clone()
    torch_opt = torch.optim.AdamW(params, lr=bench.HYPER["lr"], betas=(bench.HYPER["beta1"], bench.HYPER["beta2"]),
                                  eps=bench.HYPER["eps"], weight_decay=bench.HYPER["weight_decay"], fused=True)
    torch_step = work.torch_fused_adamw()
    for _ in range(2):
        torch_step()
        torch_opt.step()
    for ours, theirs in zip(work.params, params):
        assert torch.equal(ours, theirs.detach())
    work.torch_op_inverse()()
    for isa in kernels.available_isas():
        with kernels.use_isa(isa):
            for config in bench.CONFIGS:
                work.run(config)
                torch_step()
    for name, tensors in vars(work).items():
        if isinstance(tensors, list):
            assert all(bool(t.float().isfinite().all()) for t in tensors), name


@pytest.mark.parametrize("path", ["adamw fp32 grads", "adamw_inverse fp32 grads", "sign_sgd compute copy"])
def test_reference_check_covers_every_timed_kernel_path(monkeypatch, path):
    """A kernel wrong only on a path a timed configuration takes (fp32 gradients; SignSGD writing
    the compute copy) fails the check, as one wrong on the bf16-gradient path does."""
    name = {"adamw fp32 grads": "adamw_step", "adamw_inverse fp32 grads": "adamw_inverse_step",
            "sign_sgd compute copy": "sign_sgd_step"}[path]
    real = getattr(kernels, name)

    def wrong_on_that_path(p, g, *args, **kw):
        real(p, g, *args, **kw)
        if path == "sign_sgd compute copy":
            if kw.get("compute_params") is not None:
                kw["compute_params"][0].view(torch.int16)[:1].bitwise_xor_(1)
        elif g[0].dtype == torch.float32:
            p[0].view(torch.int32)[:1].bitwise_xor_(1)

    monkeypatch.setattr(kernels, name, wrong_on_that_path)
    with pytest.raises(AssertionError, match="differ from cpu_offload.reference"):
        bench.check_against_reference("scalar")
