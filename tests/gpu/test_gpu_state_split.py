# Part of full offload's state on the GPU (gpu_state=), on CUDA (marked gpu, skipped
# without CUDA): with half of the state on the GPU, over 20 steps, with a skipped NaN step,
# accumulation, bf16 moments and FSDP2 (one rank), GPU-stepped parameters equal the all-host
# run bit for bit; under steady clipping they equal the CPU reference stepped with each
# window's final coefficient.
# Run: pytest -m gpu tests/gpu/test_gpu_state_split.py
import math

import pytest
import torch

from cpu_offload import offload_optimizer
from cpu_offload._full.device_state import device_bytes_per_element
from cpu_offload.reference import adamw_reference_
from helpers import LM, capture_local_grads, loss_fn, make_opt, records_of, shard_blocks, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 20


def run(budget, *, accum, state_dtype, fsdp=False, nan_at=None, max_grad_norm=None, history=None, overlap=False,
        **options):
    torch.manual_seed(0)
    model = LM().cuda()
    if fsdp:
        model = shard_blocks(model)
    grads = capture_local_grads(model) if history is not None else None
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=accum, state_dtype=state_dtype,
                            gpu_state=budget, max_grad_norm=max_grad_norm, pinned_bytes=1 << 21,
                            overlap_forward=model if overlap else None, **options)
    for s in range(STEPS):
        if grads is not None:
            grads.clear()
        for micro in range(accum):
            loss = loss_fn(model, tokens(s, micro))
            (loss * (math.nan if s == nan_at else 1.0)).backward()
        opt.step()
        if history is not None:
            history.append((opt.stats()["clip_coef"], {n: sum(g[1:], g[0].clone()) for n, g in grads.items()}))
        opt.zero_grad()
    opt.wait_for_weights()
    torch.cuda.synchronize()
    by_id = {id(p): n for n, p in model.named_parameters()}
    state = {by_id[id(r.param)]: (r.on_device, r.master.cpu(), r.exp_avg.cpu(), r.exp_avg_sq.cpu(), r.step,
                                  r.local().detach().cpu()) for r in records_of(opt)}
    skipped = opt.stats()["skipped_steps"]
    opt.close()
    return model, state, skipped


def half_budget(accum, state_dtype):
    """Device bytes of about half of the model's parameters' state."""
    return sum(p.numel() for p in LM().parameters()) // 2 * device_bytes_per_element(
        moments=True, state_dtype=state_dtype, accumulate=accum > 1)


@pytest.mark.filterwarnings("ignore:cpu_offload. optimizer step skipped")
@pytest.mark.parametrize("accum, state_dtype, fsdp", [(1, torch.bfloat16, False), (2, torch.float32, False),
                                                      (2, torch.bfloat16, True)])
def test_gpu_stepped_parameters_equal_the_all_host_run_bit_for_bit(accum, state_dtype, fsdp, request):
    if fsdp:
        request.getfixturevalue("single_rank_group")
    _, host, host_skipped = run(None, accum=accum, state_dtype=state_dtype, fsdp=fsdp, nan_at=7)
    _, split, split_skipped = run(half_budget(accum, state_dtype), accum=accum, state_dtype=state_dtype,
                                  fsdp=fsdp, nan_at=7)
    assert host_skipped == split_skipped == 1
    assert 0 < sum(s[0] for s in split.values()) < len(split)  # a share of the parameters on the GPU
    for n in host:
        for a, b in zip(host[n][1:], split[n][1:]):
            assert (a == b) if isinstance(a, int) else torch.equal(a, b), n


def test_steady_clipping_gpu_stepped_equals_the_cpu_reference_with_each_coefficient():
    history = []
    model, split, _ = run(half_budget(1, torch.bfloat16), accum=1, state_dtype=torch.bfloat16,
                          max_grad_norm=1e-3, history=history)
    torch.manual_seed(0)
    init = dict(LM().named_parameters())  # the same initial weights, on the CPU
    on_gpu = [n for n, s in split.items() if s[0]]
    assert on_gpu
    for name in on_gpu:
        p = init[name].detach().float().clone()
        m, v = torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16)
        for step, (coef, grads) in enumerate(history, 1):
            assert coef < 1.0  # every step clips
            adamw_reference_(p, grads[name], m, v, step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                             weight_decay=0.1 if p.dim() > 1 else 0.0, grad_scale=coef)  # make_opt's groups
        on_device, master, exp_avg, exp_avg_sq, steps, local = split[name]
        assert on_device and steps == STEPS
        assert torch.equal(master, p.reshape(-1)) and torch.equal(exp_avg, m.reshape(-1)), name
        assert torch.equal(exp_avg_sq, v.reshape(-1)) and torch.equal(local, p.to(torch.bfloat16)), name


def test_auto_moves_what_the_peak_leaves_free_and_stays_within_it():
    from cpu_offload._full.device_state import AUTO_WINDOWS, auto_margin

    torch.manual_seed(0)
    model = LM().cuda()
    opt = offload_optimizer(make_opt(model), offload="full", gpu_state="auto", pinned_bytes=1 << 21)
    peaks = []
    for s in range(AUTO_WINDOWS + 3):
        torch.cuda.reset_peak_memory_stats()
        loss_fn(model, tokens(s)).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        moved = [r.on_device for r in records_of(opt)]
        assert all(moved) == (s >= AUTO_WINDOWS - 1) and (any(moved) == all(moved)), s  # this small model: all
    total = torch.cuda.get_device_properties(0).total_memory
    state = opt.stats()["gpu_state_bytes"]
    assert state == sum(p.numel() * 12 for p in model.parameters())
    before = max(peaks[:AUTO_WINDOWS])
    # after the move: the observed peak, the state, and the device step's temporaries (< 0.5 GiB)
    assert max(peaks[AUTO_WINDOWS:]) <= before + state + (1 << 29)
    assert max(peaks) <= total - auto_margin(total)
    opt.close()


def half_on_the_gpu():
    """A seeded model and its full-offload optimizer with about half of the state on the GPU."""
    torch.manual_seed(0)
    model = LM().cuda()
    return model, offload_optimizer(make_opt(model), offload="full", gpu_state=half_budget(1, torch.float32),
                                    pinned_bytes=1 << 21)


def test_a_host_master_written_in_place_after_the_last_backward_is_what_assigning_it_after_step_gives():
    """A host-stepped master written in place between the window's last backward (whose step
    ran during it) and step(): step() raises, keeping the written master and writing the weight
    on the GPU from it; the state then, and after two more steps, equals the run that stepped
    and assigned that master after step(), bit for bit."""
    results = {}
    for how in ("assigned after step()", "in place before step()"):
        model, opt = half_on_the_gpu()
        rec = next(r for r in records_of(opt) if not r.on_device)
        held = opt.state[rec.param]["master"]
        for s in range(4):
            loss_fn(model, tokens(s)).backward()
            written = (rec.master.view(rec.shape) * 0.5).cpu() if s == 1 else None
            if s == 1 and how == "in place before step()":
                with torch.no_grad():
                    held.copy_(written)
                with pytest.raises(RuntimeError, match="written in place after the window's last backward pass"):
                    opt.step()
            else:
                opt.step()
            if s == 1 and how == "assigned after step()":
                opt.state[rec.param]["master"] = written.to(rec.master.device)
            opt.zero_grad()
            if s == 1:
                torch.cuda.synchronize()
                assert torch.equal(rec.master.view(rec.shape).cpu(), written)
                assert torch.equal(rec.local().detach().cpu(), written.to(torch.bfloat16))
        torch.cuda.synchronize()
        results[how] = [(r.master.cpu(), r.exp_avg.cpu(), r.exp_avg_sq.cpu(), r.step, r.local().detach().cpu())
                        for r in records_of(opt)]
        opt.close()
    for a, b in zip(*results.values()):
        assert all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


@pytest.mark.filterwarnings("ignore:cpu_offload. backward pass")
def test_masters_written_in_place_on_either_device_are_taken_and_the_next_backward_raises():
    """A master handed out (``opt.state[p]["master"]``) lives in host RAM or on the GPU: written
    in place on either, the backward after it raises and the weight becomes round(master); the
    window run again equals the run that assigned the masters, bit for bit."""
    results = {}
    for how in ("assigned", "in place"):
        model, opt = half_on_the_gpu()
        recs = records_of(opt)
        edited = [next(r for r in recs if r.on_device), next(r for r in recs if not r.on_device)]
        for s in range(4):
            if s == 2:
                for r in edited:
                    new = r.master.view(r.shape) * 0.5
                    if how == "assigned":
                        opt.state[r.param]["master"] = new
                    else:
                        with torch.no_grad():
                            opt.state[r.param]["master"].copy_(new)
                if how == "in place":
                    assert not any(torch.equal(r.local().detach().reshape(-1).cpu(), r.master.to(torch.bfloat16).cpu())
                                   for r in edited)
                    with pytest.raises(RuntimeError, match=r"\(opt.state\[p\]\['master'\]\) were written in place"):
                        loss_fn(model, tokens(s)).backward()
                    assert all(torch.equal(r.local().detach().reshape(-1).cpu(), r.master.to(torch.bfloat16).cpu())
                               for r in edited)
                    opt.zero_grad()
            loss_fn(model, tokens(s)).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        results[how] = [(r.master.cpu(), r.exp_avg.cpu(), r.local().detach().cpu()) for r in recs]
        opt.close()
    for a, b in zip(results["assigned"], results["in place"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
