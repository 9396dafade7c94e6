# Full offload with bf16 AdamW moments (state_dtype=torch.bfloat16) on CPU
# parameters: option checks, the host buffers and their byte count, bit-exact
# agreement with the reference fed bf16 moments, checkpoints in either moment
# dtype, and a resume that continues bit-identically.
import io

import pytest
import torch

import cpu_offload
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._full.host_state import host_bytes_needed
from helpers import SMALL, batches, build, expected, host_bytes_of, named, records_of, run

BF16 = dict(SMALL, state_dtype=torch.bfloat16)


def train(model, off, steps, k):
    for s in steps:
        for x, extra in batches(s, k):
            model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()


def test_bad_state_dtype_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="state_dtype must be torch.float32 or torch.bfloat16"):
        FullCPUOffloadOptimizer(build("adamw")[1], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="state_dtype must be"):
        FullCPUOffloadOptimizer(build("adamw")[1], state_dtype="bfloat16")
    with pytest.raises(ValueError, match="state_dtype=torch.bfloat16 .*SignSGD"):
        FullCPUOffloadOptimizer(build("sign_sgd")[1], state_dtype=torch.bfloat16)
    model, opt = build("adamw")
    with pytest.raises(TypeError, match="state_dtype is an option of offload='full'"):
        cpu_offload.offload_optimizer(opt, offload="optimizer", state_dtype=torch.bfloat16)
    # a refused construction leaves the model as it was
    assert all(p.dtype == torch.float32 for p in model.parameters())
    FullCPUOffloadOptimizer(build("sign_sgd")[1], state_dtype=torch.float32).close()  # the default is fine


def test_moments_are_bf16_and_the_host_bytes_shrink():
    model, opt = build("adamw")
    off = cpu_offload.offload_optimizer(opt, offload="full", state_dtype=torch.bfloat16, grad_copy="host", **SMALL)
    assert isinstance(off, FullCPUOffloadOptimizer)
    for rec in records_of(off):
        assert rec.master.dtype == torch.float32
        assert rec.exp_avg.dtype == rec.exp_avg_sq.dtype == torch.bfloat16
    padded = sum((r.numel + 15) // 16 * 16 for r in records_of(off))
    assert host_bytes_of(off) == padded * 10  # 4 B master + 2 x 2 B moments + the 2 B bf16 gradient copy
    recs = records_of(off)
    assert host_bytes_needed(recs, moments=True, accumulate=False, state_dtype=torch.bfloat16) == padded * 10
    assert host_bytes_needed(recs, moments=True, accumulate=True, state_dtype=torch.bfloat16) == padded * 12
    assert host_bytes_needed(recs, moments=True, accumulate=False) == padded * 14
    assert host_bytes_needed(recs, moments=True, accumulate=True) == padded * 16
    train(model, off, range(1), 1)
    assert off.stats()["host_bytes"] == padded * 10


@pytest.mark.parametrize("k", [1, 3])
def test_matches_reference_with_bf16_moments_bit_exactly(k):
    model, off, init, history = run("adamw", k, 6, **BF16)
    exact = expected("adamw", init, history, exact=True, moment_dtype=torch.bfloat16)
    assert off.stats()["chunks"] > 2
    for n, rec in named(model, off).items():
        master = rec.master.view(rec.shape)
        assert torch.equal(master, exact[n]), n  # the kernel's bf16-moment path is the reference's
        assert torch.equal(rec.param.detach(), master.to(torch.bfloat16)), n


def test_state_dict_holds_bf16_moments():
    model, off, _, _ = run("adamw", 1, 2, **BF16)
    entry = off.state_dict()["state"][named(model, off)["l2.weight"].index]
    assert entry["master"].dtype == torch.float32
    assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.bfloat16
    assert entry["exp_avg"].shape == (64, 64) and entry["step"].item() == 2.0


def test_fp32_moments_load_into_bf16_state_rounded_like_to():
    model, off, _, _ = run("adamw", 1, 3, **SMALL)  # fp32 moments
    sd = off.state_dict()
    model2, opt2 = build("adamw")
    off2 = FullCPUOffloadOptimizer(opt2, **BF16)
    off2.load_state_dict(sd)
    for a, b in zip(records_of(off), records_of(off2)):
        assert torch.equal(b.master, a.master) and b.step == a.step, a.name
        assert torch.equal(b.exp_avg, a.exp_avg.to(torch.bfloat16)), a.name
        assert torch.equal(b.exp_avg_sq, a.exp_avg_sq.to(torch.bfloat16)), a.name
    # and back: bf16 moments widen exactly into an fp32-state optimizer
    model3, opt3 = build("adamw")
    off3 = FullCPUOffloadOptimizer(opt3, **SMALL)
    off3.load_state_dict(off2.state_dict())
    for b, c in zip(records_of(off2), records_of(off3)):
        assert c.exp_avg.dtype == torch.float32 and torch.equal(c.exp_avg, b.exp_avg.float()), b.name
        assert torch.equal(c.exp_avg_sq, b.exp_avg_sq.float()), b.name


def test_state_dict_resume_with_bf16_moments_is_bit_identical():
    def fresh():
        model, opt = build("adamw")
        return model, FullCPUOffloadOptimizer(opt, grad_accum_steps=2, **BF16)

    model, off = fresh()
    train(model, off, range(3), 2)
    buf = io.BytesIO()
    torch.save(off.state_dict(), buf)
    train(model, off, range(3, 6), 2)
    final = {n: (r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone()) for n, r in named(model, off).items()}

    model2, off2 = fresh()
    buf.seek(0)
    off2.load_state_dict(torch.load(buf))
    train(model2, off2, range(3, 6), 2)
    for n, rec in named(model2, off2).items():
        master, m, v = final[n]
        assert torch.equal(rec.master, master) and torch.equal(rec.exp_avg, m) and torch.equal(rec.exp_avg_sq, v), n
