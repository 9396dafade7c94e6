# Part of the state on the device (gpu_state=), on CPU parameters: the "device" is then the
# CPU and its records are stepped by device_state.py's operations instead of the native
# kernel. Any split trains bit for bit like the all-host run (AdamW with fp32 or bf16
# moments, SignSGD, accumulation, zero-filled gradients, skipped steps); under clipping the
# device records equal the reference stepped with each window's final coefficient; the
# budget picks parameters spread evenly over the optimizer's order; checkpoints load across
# splits; bad values are refused; an out-of-memory error while "auto" moves state leaves each
# record whole on the host or the device.
import gc
import math
import signal
import sys
import warnings

import pytest
import torch

from cpu_offload._full import device_state
from cpu_offload._full.device_state import device_bytes_per_element
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload.reference import adamw_reference_
from helpers import (HALF_STATE, SMALL, assert_same_state, batches, build, capture, host_bytes_of, named, records_of,
                     staging_rings_of, train_step)

EVERYTHING = 1 << 40


def all_host_bytes() -> tuple:
    """The all-host run's host state bytes, and the bytes of its bf16 gradients (what
    grad_copy="device" keeps on the device at the end of backward)."""
    model, opt = build("adamw")
    full = FullCPUOffloadOptimizer(opt, **SMALL)
    needed, kept = host_bytes_of(full), sum(r.numel for r in records_of(full)) * 2
    full.close()
    return needed, kept


def half(kind, k, state_dtype):
    """The budget of about half of the model's device state."""
    return 3100 * device_bytes_per_element(moments=kind == "adamw", state_dtype=state_dtype, accumulate=k > 1)


def train(kind, k, steps, *, gpu_state, zero_fill=False, nan_at=None, loss_scale=1.0, clip=None, **opts):
    model, opt = build(kind)
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, gpu_state=gpu_state, **SMALL, **opts)
    history = []
    for s in range(steps):
        grads.clear()
        for x, extra in batches(s, k):
            scale = math.nan if s == nan_at else loss_scale * (1 + s % 3)
            (model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean() * scale).backward()
        if clip is not None:
            off.clip_grad_norm_(clip)
        off.step()
        history.append((off.stats()["clip_coef"], {n: sum(g[1:], g[0].clone()) for n, g in grads.items()}))
        off.zero_grad(set_to_none=not zero_fill)
    return model, off, history


def state_of(model, off):
    return {n: (r.master.cpu().clone(), None if r.exp_avg is None else r.exp_avg.cpu().clone(),
                None if r.exp_avg_sq is None else r.exp_avg_sq.cpu().clone(), r.step, r.param.detach().clone())
            for n, r in named(model, off).items()}


@pytest.mark.filterwarnings("ignore:cpu_offload. optimizer step skipped")
@pytest.mark.parametrize("kind, k, state_dtype, zero_fill", [
    ("adamw", 1, torch.float32, False), ("adamw", 2, torch.float32, True), ("adamw", 1, torch.bfloat16, True),
    ("adamw", 3, torch.bfloat16, False), ("sign_sgd", 1, torch.float32, False), ("sign_sgd", 2, torch.float32, True)])
@pytest.mark.parametrize("split", ["half", "everything"])
def test_any_split_trains_bit_for_bit_like_the_all_host_run(kind, k, state_dtype, zero_fill, split):
    opts = dict(state_dtype=state_dtype) if kind == "adamw" else {}
    budget = half(kind, k, state_dtype) if split == "half" else EVERYTHING
    host_model, host, _ = train(kind, k, 6, gpu_state=None, zero_fill=zero_fill, nan_at=3, **opts)
    split_model, split, _ = train(kind, k, 6, gpu_state=budget, zero_fill=zero_fill, nan_at=3, **opts)
    on_device = [r.name for r in records_of(split) if r.on_device]
    assert 0 < len(on_device) < len(records_of(split)) if budget != EVERYTHING else len(records_of(split))
    assert host.stats()["gpu_state_bytes"] == 0 and split.stats()["gpu_state_bytes"] > 0
    assert split.stats()["host_bytes"] < host.stats()["host_bytes"]
    assert host.stats()["skipped_steps"] == split.stats()["skipped_steps"] == 1  # the NaN step
    assert_same_state(state_of(host_model, host), state_of(split_model, split))


def test_the_fused_step_check_accepts_the_reference_operations_and_names_what_fails():
    cpu = torch.device("cpu")
    assert device_state.check_fused_step(cpu, fused=device_state.adamw_piece_) is None

    def one_ulp_off(p, *args, **kwargs):
        device_state.adamw_piece_(p, *args, **kwargs)
        p[-3] = torch.nextafter(p[-3], torch.tensor(math.inf))  # in the tail, past two blocks

    def no_kernel_image(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")
    assert device_state.check_fused_step(cpu, fused=one_ulp_off) == (
        "its master differs from the reference's operations with torch.float32 moments")
    assert device_state.check_fused_step(cpu, fused=no_kernel_image) == (
        "RuntimeError: no kernel image is available for execution on the device")


def test_the_fused_step_check_refuses_a_kernel_that_flushes_subnormals():
    """Moments decay into float32's subnormal range where gradients stay zero (a rare token's
    embedding row: 0.9**810 * 1e-3 < 2**-126), and a kernel compiled to flush subnormals to zero
    would step those parameters unlike the host kernel. The check's data held no subnormal, so
    such a kernel passed it."""
    def flushes_subnormals(p, grad, m, v, *args, **kwargs):
        device_state.adamw_piece_(p, grad, m, v, *args, **kwargs)
        for t in (p, m, v):
            t[t.abs() < torch.finfo(torch.float32).tiny] = 0.0

    reason = device_state.check_fused_step(torch.device("cpu"), fused=flushes_subnormals)
    assert reason is not None and "differs from the reference's operations with torch.float32 moments" in reason


@pytest.fixture
def fresh_fused_check():
    device_state._fused_step_usable.cache_clear()
    yield
    device_state._fused_step_usable.cache_clear()


def test_a_fused_step_that_fails_its_check_warns_once_and_the_torch_operations_step(monkeypatch, fresh_fused_check):
    # The device "fused kernel" here fails to launch; the check catches it at the first device
    # step, warns once, and every device record is stepped by the torch operations instead:
    # the run still equals the all-host one bit for bit.
    launches = []

    def failing(*args, **kwargs):
        launches.append(1)
        raise RuntimeError("simulated compilation failure")
    monkeypatch.setattr(device_state, "fused_adamw_available", lambda *tensors: True)
    monkeypatch.setattr(device_state, "fused_adamw_", failing)
    host_model, host, _ = train("adamw", 1, 4, gpu_state=None)
    with pytest.warns(RuntimeWarning, match=r"fused AdamW step cannot be used on cpu \(RuntimeError: simulated "
                                            r"compilation failure\); .* run as torch operations") as caught:
        split_model, split, _ = train("adamw", 1, 4, gpu_state=HALF_STATE)
    assert sum("fused AdamW" in str(w.message) for w in caught) == 1 and launches == [1]  # checked once
    assert any(r.on_device for r in records_of(split))
    assert_same_state(state_of(host_model, host), state_of(split_model, split))


@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
@pytest.mark.parametrize("k, state_dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_clipped_device_records_equal_the_reference_with_each_final_coefficient(k, state_dtype, how, monkeypatch):
    clip = dict(max_grad_norm=1e-4) if how == "max_grad_norm" else dict(clip=1e-4)
    calls = []
    real = device_state.adamw_piece_
    monkeypatch.setattr(device_state, "adamw_piece_", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model, off, history = train("adamw", k, 8, gpu_state=half("adamw", k, state_dtype), state_dtype=state_dtype,
                                **clip)
    # NOTE: the redo of a clipped step steps host parameters only: each device one is stepped
    # by the device path once per window (on CPU parameters the host kernel would give the
    # same bits, so only the count tells them apart)
    on_device = {n for n, r in named(model, off).items() if r.on_device}
    assert len(calls) == sum(len(on_device & grads.keys()) for _, grads in history) > len(history)
    ref_model, _ = build("adamw")  # the same initial fp32 weights: the masters start from them
    for name, rec in named(model, off).items():
        if not rec.on_device:
            continue
        p = ref_model.get_parameter(name).detach().float().clone().reshape(-1)
        m, v, step = torch.zeros_like(p, dtype=state_dtype), torch.zeros_like(p, dtype=state_dtype), 0
        group = off.param_groups[rec.group]
        for coef, grads in history:
            assert coef is not None and coef < 1.0  # every step clips
            if name not in grads:
                continue  # no gradient in that window: not stepped, as torch skips it
            step += 1
            adamw_reference_(p, grads[name].reshape(-1), m, v, step, lr=group["lr"], beta1=group["betas"][0],
                             beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                             grad_scale=coef)
        assert torch.equal(rec.master, p) and torch.equal(rec.exp_avg, m) and torch.equal(rec.exp_avg_sq, v), name
        assert rec.step == step


class Rec:
    def __init__(self, numel):
        self.numel = numel


def test_the_budget_takes_parameters_spread_evenly_over_the_order():
    recs = [Rec(100) for _ in range(8)]
    assert device_state.choose_device_records(recs, 400 * 12, 12) == recs[1::2]
    assert device_state.choose_device_records(recs, 200 * 12, 12) == recs[3::4]
    assert device_state.choose_device_records(recs, 800 * 12, 12) == recs
    assert device_state.choose_device_records(recs, 99 * 12, 12) == []
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        recs = [Rec(int(n)) for n in torch.randint(0, 1000, (int(torch.randint(1, 40, (1,), generator=gen)),),
                                                   generator=gen)]
        total = sum(r.numel for r in recs)
        budget = int(torch.randint(0, total + 1, (1,), generator=gen)) * 4
        chosen = {id(r) for r in device_state.choose_device_records(recs, budget, 4)}
        used = seen = 0
        for r in recs:
            seen += r.numel
            used += r.numel if id(r) in chosen else 0
            assert used * 4 * total <= budget * seen  # never ahead of the budget's share of the order
            assert used * 4 * total > budget * seen - 4 * total * max(x.numel for x in recs)  # nor far behind


def test_a_budget_on_a_model_stays_within_it_and_zero_keeps_all_on_the_host():
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=HALF_STATE, **SMALL)
    on_device = [r for r in records_of(off) if r.on_device]
    assert 0 < len(on_device) < len(records_of(off)) and sum(r.numel * 12 for r in on_device) <= HALF_STATE
    assert records_of(off)[0] not in on_device  # l1.weight (1536 of 6293 elements) is ahead of the budget's share
    off.close()
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=0, **SMALL)
    assert not any(r.on_device for r in records_of(off))


def test_the_host_shortage_is_covered_by_parameters_spread_over_the_order():
    recs = [Rec(100) for _ in range(8)]
    by_numel = lambda r: r.numel  # noqa: E731
    assert device_state.records_to_free_host(recs, 400, by_numel) == recs[0::2]
    chosen = device_state.records_to_free_host(recs, 401, by_numel)
    assert sum(r.numel for r in chosen) >= 401 and len(chosen) == 5
    assert device_state.records_to_free_host(recs, 800, by_numel) == recs
    assert device_state.records_to_free_host(recs, 801, by_numel) is None  # cannot cover it


def assert_a_checkpoint_loads_across(saved_with: dict, loaded_with: dict) -> None:
    """A checkpoint of a run with the options ``saved_with`` loads, bit for bit, into an
    optimizer built with ``loaded_with`` (a split of the state, a stream share)."""
    model, saved, _ = train("adamw", 1, 3, **{"gpu_state": None, **saved_with})
    sd = saved.state_dict()
    sd = {"state": {i: {k: v.clone() for k, v in e.items()} for i, e in sd["state"].items()},
          "param_groups": sd["param_groups"]}
    expected = state_of(model, saved)
    other, opt = build("adamw", seed=1)
    off = FullCPUOffloadOptimizer(opt, **loaded_with, **SMALL)
    off.load_state_dict(sd)
    loaded = state_of(other, off)
    for n, (master, m, v, step, _) in expected.items():
        assert torch.equal(loaded[n][0], master) and torch.equal(loaded[n][1], m) and torch.equal(loaded[n][2], v)
        assert loaded[n][3] == step and torch.equal(loaded[n][4], master.view_as(loaded[n][4]).bfloat16()), n


@pytest.mark.parametrize("save_budget, load_budget", [(None, HALF_STATE), (EVERYTHING, None), (HALF_STATE, EVERYTHING)])
def test_a_checkpoint_loads_with_any_split(save_budget, load_budget):
    assert_a_checkpoint_loads_across(dict(gpu_state=save_budget), dict(gpu_state=load_budget))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "all", [1]])
def test_bad_gpu_state_values_are_refused_naming_the_argument(bad):
    model, opt = build("adamw")
    with pytest.raises(ValueError, match="gpu_state"):
        FullCPUOffloadOptimizer(opt, gpu_state=bad, **SMALL)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed


# ------------------------------------------------------------------ gpu_state="auto"
GIB = 1 << 30


def test_auto_settles_after_three_windows_within_its_budget_and_trains_bit_for_bit(monkeypatch):
    # a fake device of 4 GiB + 40000 bytes whose windows peak at 1000 bytes: the margin is
    # 4 GiB, so 39000 bytes are left for state
    peaks = []
    monkeypatch.setattr(device_state, "memory_reading", lambda device: peaks.append(1) or (4 * GIB + 40_000, 1000))
    budget = 40_000 - 1000
    model, off, _ = train("adamw", 1, 2, gpu_state="auto")
    assert not any(r.on_device for r in records_of(off)) and len(peaks) == 2  # not settled yet
    expected = device_state.choose_device_records(records_of(off), budget, 12)
    assert 0 < len(expected) < len(records_of(off))
    entry = off.state[expected[0].param]  # held across the move: it reads the moved state
    old_master = entry["master"]
    train_step(model, off, 2, 1)
    off.step()
    off.zero_grad()
    assert [r for r in records_of(off) if r.on_device] == expected
    assert entry["master"].data_ptr() == expected[0].master.data_ptr() != old_master.data_ptr()
    host_model, host, _ = train("adamw", 1, 7, gpu_state=None)
    auto_model, auto, _ = train("adamw", 1, 7, gpu_state="auto")
    used = sum(r.numel * 12 for r in records_of(auto) if r.on_device)
    assert 0 < used <= budget and auto.stats()["gpu_state_bytes"] == used
    assert_same_state(state_of(host_model, host), state_of(auto_model, auto))  # across the move, bit for bit


@pytest.mark.parametrize("fail_at", [1, 2, 3, 6])
def test_an_out_of_memory_while_auto_moves_the_state_leaves_each_record_whole(monkeypatch, fail_at):
    # grad_accum_steps=2: each record moved allocates its two moments and its accumulator on
    # the device; an out-of-memory at the fail_at-th of them stops the move there
    monkeypatch.setattr(device_state, "memory_reading", lambda device: (4 * GIB + 40_000, 1000))
    host_model, host, _ = train("adamw", 2, 6, gpu_state=None)
    model, off, _ = train("adamw", 2, 2, gpu_state="auto")
    move, zeros, calls = off._device.add, torch.zeros, []

    def zeros_until_out_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise torch.OutOfMemoryError("out of memory")
        return zeros(*args, **kwargs)

    def add_failing(records):
        with monkeypatch.context() as m:
            m.setattr(torch, "zeros", zeros_until_out_of_memory)
            move(records)

    monkeypatch.setattr(off._device, "add", add_failing)
    train_step(model, off, 2, 2, loss_factor=3)
    with pytest.warns(RuntimeWarning, match="stopped moving state to the device: out of memory"):
        off.step()
    off.zero_grad()
    host_buffers = {t.untyped_storage().data_ptr() for t in (off._host.master, off._host.accum)}
    for rec in records_of(off):
        in_host = {t.untyped_storage().data_ptr() in host_buffers for t in (rec.master, rec.accum)}
        assert in_host == {not rec.on_device}, rec.name
    assert sum(r.on_device for r in records_of(off)) == (fail_at - 1) // 3
    for s in range(3, 6):
        train_step(model, off, s, 2, loss_factor=1 + s % 3)
        off.step()
        off.zero_grad()
    assert_same_state(state_of(host_model, host), state_of(model, off))


def test_auto_without_a_memory_reading_keeps_everything_on_the_host():
    model, off, _ = train("adamw", 1, 4, gpu_state="auto")  # CPU parameters: no reading
    assert not any(r.on_device for r in records_of(off)) and off.stats()["gpu_state_bytes"] == 0


def test_auto_puts_parameters_on_the_device_when_the_host_cannot_hold_the_state(monkeypatch):
    from cpu_offload._full import host_state, optimizer as optimizer_module

    needed, _ = all_host_bytes()
    pinned = 2 * SMALL["num_slots"] * (SMALL["pinned_bytes"] // (2 * SMALL["num_slots"]))
    short = 19_000  # more than l1.weight's 1536 x 12 = 18432 bytes
    for module in (host_state, optimizer_module):
        monkeypatch.setattr(module, "available_host_ram", lambda: needed + pinned - short)
    monkeypatch.setattr(device_state, "host_margin", lambda: 0)
    monkeypatch.setattr(device_state, "free_memory", lambda device: (8 * GIB, 8 * GIB))
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL)
    assert needed - host_bytes_of(off) >= short and not all(r.on_device for r in records_of(off))
    state = sum(r.numel * 12 for r in records_of(off) if r.on_device)
    kept = sum(r.numel for r in records_of(off)) * 2  # every bf16 gradient, kept on the device to the window's end
    off.close()
    # the device's room: free - margin (4 GiB) - the kept gradients, which the state must fit in
    for free, fits in ((4 * GIB + state + kept, True), (4 * GIB + state + kept - 1, False), (4 * GIB + 1000, False)):
        monkeypatch.setattr(device_state, "free_memory", lambda device, free=free: (free, 8 * GIB))
        model, opt = build("adamw")
        if fits:
            FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL).close()
        else:
            # the message names what the state needs on the device and the room it found
            room = max(free - 4 * GIB - kept, 0)
            with pytest.raises(MemoryError, match=f"host RAM.*needs {state} bytes there, but the device has room "
                                                  f"for {room} "):
                FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL)
    for module in (host_state, optimizer_module):  # short of more than the whole state
        monkeypatch.setattr(module, "available_host_ram", lambda: pinned // 2)
    model, opt = build("adamw")
    with pytest.raises(MemoryError, match="host RAM.*falls short even with every parameter's state on the device"):
        FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed


def test_auto_sizes_the_staging_rings_for_the_parameters_left_on_the_host(monkeypatch):
    # At 20B the rings were sized before the move, with no host RAM left for them (512 MiB),
    # and stayed so although the move had made room: they are sized again after it.
    from cpu_offload._full import host_state, optimizer as optimizer_module

    needed, _ = all_host_bytes()
    for module in (host_state, optimizer_module):
        monkeypatch.setattr(module, "available_host_ram", lambda: needed)  # no room for any ring
    monkeypatch.setattr(device_state, "host_margin", lambda: 100)
    monkeypatch.setattr(device_state, "free_memory", lambda device: (8 * GIB, 8 * GIB))
    calls = []
    real = optimizer_module.staging_rings
    monkeypatch.setattr(optimizer_module, "staging_rings",
                        lambda recs, *a, room, **kw: calls.append((list(recs), room)) or real(recs, *a, room=room, **kw))
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL)
    host = [r for r in records_of(off) if not r.on_device]
    mib = 1 << 20
    assert len(host) < len(records_of(off)) and len(calls) == 12
    assert calls[0][1] == 0  # before the move: no room
    # the sizes the rings may take, from their default down to the smallest in 512 MiB steps
    assert [room for _, room in calls[1:-1]] == [1 << 62] + [k * 512 * mib for k in range(8, -1, -1)]
    assert calls[-1][0] == host and calls[-1][1] == needed - host_bytes_of(off) - 100  # after the move: what it freed
    off.close()


def test_auto_keeps_the_largest_rings_whose_state_the_device_can_take(monkeypatch):
    # At 21B the device's room lay between what the smallest rings and what the default
    # ones needed moved there, and the smallest were taken (backward waited 2.6 s a step for
    # slots instead of 1.1 s). The sizes between are tried, largest first.
    from cpu_offload._full import host_state, optimizer as optimizer_module, options
    from cpu_offload._full.options import Rings

    needed, kept = all_host_bytes()
    # the default first, which no split frees room for, then 80, 48 and 16 KiB; sizes are
    # tried in steps of PINNED_MIN up from 0 to PINNED_MAX, here 16 and 128 KiB
    default, large, medium, small = (Rings(2, 2, 4096 * k) for k in (12, 5, 3, 1))
    monkeypatch.setattr(options, "PINNED_MIN", small.nbytes)
    monkeypatch.setattr(options, "PINNED_MAX", 8 * small.nbytes)
    available = needed + small.nbytes - 1000
    for module in (host_state, optimizer_module):
        monkeypatch.setattr(module, "available_host_ram", lambda: available)
    monkeypatch.setattr(device_state, "host_margin", lambda: 0)

    def construct(free, staging_rings):
        monkeypatch.setattr(optimizer_module, "staging_rings", staging_rings)
        monkeypatch.setattr(device_state, "free_memory", lambda device: (free, 8 * GIB))
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL)
        cost = sum(r.numel * 12 for r in records_of(off) if r.on_device)
        d2h, h2d = staging_rings_of(off)
        rings = Rings(len(d2h.slots), len(h2d.slots), d2h.slot_bytes)
        assert host_bytes_of(off) + rings.nbytes <= available  # the rings fit beside the host state
        off.close()
        return cost, rings

    def graded(recs, *args, room, fill=False, **kwargs):  # staging_rings' rule, on these sizes
        fits = [r for r in (default, large, medium) if r.nbytes <= room]
        return fits[0] if fits and (fill or fits[0] == default) else small

    # what each size needs moved to the device, when it is the only one
    cost = {r: construct(8 * GIB, lambda recs, *a, r=r, **kw: r)[0] for r in (large, medium, small)}
    assert cost[large] > cost[medium] > cost[small] > 0
    assert construct(8 * GIB, graded) == (cost[large], large)
    for ring, smaller in ((large, medium), (medium, small)):
        # room for ring's state: that state, and rings at least that large (as large as the
        # host room it freed holds); a byte less: the next size's
        for room, size in ((cost[ring], ring), (cost[ring] - 1, smaller)):
            moved, rings = construct(4 * GIB + kept + room, graded)
            assert moved == cost[size] and rings.nbytes >= size.nbytes


def test_auto_falls_back_to_the_smallest_rings_when_the_device_cannot_take_the_state_for_the_default(monkeypatch):
    # At 21B the host could keep room for the default rings only with more state on the
    # device than it had room for: the smallest rings leave the device less to take.
    from cpu_offload._full import host_state, optimizer as optimizer_module
    from cpu_offload._full.options import Rings

    needed, kept = all_host_bytes()
    small, large = Rings(2, 2, 4096), Rings(2, 2, 16384)  # 16 KiB and 64 KiB
    short = 19_000
    for module in (host_state, optimizer_module):
        monkeypatch.setattr(module, "available_host_ram", lambda: needed + small.nbytes - short)
    monkeypatch.setattr(device_state, "host_margin", lambda: 0)
    sized = []

    def two_sizes(recs, *args, room, **kwargs):
        sized.append(large if room >= large.nbytes else small)
        return sized[-1]
    monkeypatch.setattr(optimizer_module, "staging_rings", two_sizes)

    def construct(free):
        monkeypatch.setattr(device_state, "free_memory", lambda device: (free, 8 * GIB))
        sized.clear()
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, gpu_state="auto", **SMALL)
        on_device = [r.name for r in records_of(off) if r.on_device]
        cost = sum(r.numel * 12 for r in records_of(off) if r.on_device)
        freed = needed - host_bytes_of(off)
        off.close()
        return on_device, cost, freed, sized[-1]

    _, roomy_cost, roomy_freed, roomy_rings = construct(8 * GIB)
    assert roomy_rings == large and roomy_freed >= short + large.nbytes - small.nbytes
    monkeypatch.setattr(optimizer_module, "staging_rings", lambda recs, *a, room, **kw: sized.append(small) or small)
    tight, tight_cost, tight_freed, _ = construct(8 * GIB)  # what the smallest rings need moved
    assert tight_freed >= short and tight_cost < roomy_cost
    monkeypatch.setattr(optimizer_module, "staging_rings", two_sizes)
    on_device, cost, _, rings = construct(4 * GIB + kept + tight_cost)
    assert (on_device, cost, rings) == (tight, tight_cost, small)
    with pytest.raises(MemoryError, match=f"needs {tight_cost} bytes there, but the device has room for "
                                          f"{tight_cost - 1} "):
        construct(4 * GIB + kept + tight_cost - 1)


def test_a_weight_edited_between_the_last_backward_and_step_is_what_a_device_record_steps():
    """A device record's weights are still those before the step until step() (host records'
    are updated during backward). An edit made in between was overwritten by the device step's
    compute copy, lost without a word; it is now the weight the step updates, as in torch."""
    model, opt = build("adamw")
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, gpu_state=EVERYTHING, **SMALL)
    rec = named(model, off)["l1.weight"]
    assert rec.on_device
    train_step(model, off, 0, 1)
    off.step()
    off.zero_grad()
    grads.clear()
    train_step(model, off, 1, 1)
    edited = torch.randn(rec.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        model.l1.weight.copy_(edited)
    master, exp_avg, exp_avg_sq = edited.float().reshape(-1), rec.exp_avg.clone(), rec.exp_avg_sq.clone()
    off.step()
    group = off.param_groups[rec.group]
    adamw_reference_(master, grads["l1.weight"][0].reshape(-1), exp_avg, exp_avg_sq, rec.step, lr=group["lr"],
                     beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                     weight_decay=group["weight_decay"])
    assert torch.equal(rec.master, master) and torch.equal(rec.exp_avg_sq, exp_avg_sq)
    assert torch.equal(model.l1.weight.detach().reshape(-1), master.to(torch.bfloat16))
    off.close()


def window_without_step(gpu_state, call, *, clipped_before=False):
    """Two steps (the second clipped when ``clipped_before``: the window after it holds its
    chunks back until it closes), a last backward, then ``call(model, off)``; returns the
    model, the wrapper and every parameter's master, step and weight after it."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=gpu_state, **SMALL)
    for s in range(2):
        train_step(model, off, s, 1)
        if clipped_before and s == 1:
            off.clip_grad_norm_(1e-3)
        off.step()
        off.zero_grad()
    train_step(model, off, 2, 1)
    call(model, off)
    return model, off, {n: (r.master.cpu().clone(), r.step, r.param.detach().clone())
                        for n, r in named(model, off).items()}


@pytest.mark.parametrize("clipped_before", [False, True])
def test_close_after_the_last_backward_completes_the_step_for_every_split(clipped_before):
    """close() without step() after a window's last backward: the host records had the update
    during backward and kept it, the device records were left without it, so the model ended
    half updated, the split deciding which half, with no word. close() now closes the window
    as zero_grad() does: every parameter takes the update, bit for bit as step() gives it."""
    for gpu_state in (HALF_STATE, None):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, off, got = window_without_step(gpu_state, lambda model, off: off.close(), clipped_before=clipped_before)
        assert gpu_state is None or 0 < sum(r.on_device for r in records_of(off)) < len(records_of(off))
        *_, want = window_without_step(gpu_state, lambda model, off: off.step(), clipped_before=clipped_before)
        assert want["l1.weight"][1] == want["l2.bias"][1] == 3  # the window's update counts
        for n, (master, step, weight) in want.items():
            assert step == got[n][1] and torch.equal(master, got[n][0]) and torch.equal(weight, got[n][2]), n
        assert [str(w.message) for w in caught if "close() without step()" in str(w.message)], gpu_state


@pytest.mark.parametrize("clipped_before", [False, True])
@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "half_on_the_device"])
def test_state_dict_between_the_last_backward_and_step_raises_and_changes_nothing(gpu_state, clipped_before):
    """opt.state_dict() after the window's last backward and before step() saved the host
    records' state after the step and the device records' before it (a resume lost one step
    of those only); in the window after a clipped step it stepped the held-back chunks at once,
    so a clip made after it took a rollback of 1e-3 and changed the training; and an edit made
    before it escaped step()'s check. It now raises, as a read of opt.state does there, and
    the step then comes out bit for bit as without the call."""
    def then_step(model, off):
        off.clip_grad_norm_(1e-3)
        off.step()

    def state_dict_then_step(model, off):
        with pytest.raises(RuntimeError, match=r"state_dict\(\) after the window's last backward pass, before "
                                               r"step\(\).*call it after step\(\)"):
            off.state_dict()
        then_step(model, off)

    *_, want = window_without_step(gpu_state, then_step, clipped_before=clipped_before)
    *_, got = window_without_step(gpu_state, state_dict_then_step, clipped_before=clipped_before)
    for n, (master, step, weight) in want.items():
        assert step == got[n][1] and torch.equal(master, got[n][0]) and torch.equal(weight, got[n][2]), n


@pytest.mark.parametrize("gpu_state", [EVERYTHING, HALF_STATE], ids=["all_on_the_device", "half_on_the_device"])
def test_a_device_step_that_fails_inside_a_parameter_names_it_as_partly_updated(gpu_state, monkeypatch):
    """An out-of-memory on a temporary of the device step, after the parameter's master had
    been changed in place (weight decay) and before its moments were: step() said "0 of 8
    parameters had their update applied" (all on the device), so training went on from a
    master that matched no step. It now names the parameter and asks for the checkpoint."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=gpu_state, **SMALL)
    train_step(model, off, 0, 1)
    off.step()
    off.zero_grad()
    real, calls = device_state._f32, [0]

    def failing(value, like):
        calls[0] += 1
        if calls[0] == 3:  # adamw_piece_: after p *= 1 - lr * wd
            raise torch.OutOfMemoryError("out of memory (injected)")
        return real(value, like)

    train_step(model, off, 1, 1)
    before = {n: (r.master.clone(), r.step) for n, r in named(model, off).items()}
    monkeypatch.setattr(device_state, "_f32", failing)
    with pytest.raises(RuntimeError, match="only partly updated.*reload the last checkpoint") as err:
        off.step()
    torn = [r.name for n, r in named(model, off).items()
            if r.on_device and not torch.equal(r.master, before[n][0]) and r.step == before[n][1]]
    assert len(torn) == 1 and f"[{torn[0]!r}]" in str(err.value)
    assert isinstance(err.value.__context__, torch.OutOfMemoryError)
    off.close()


def _weights_after_a_window_without_step(gpu_state, clip, end):
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=gpu_state, **SMALL)
    for s in range(2):
        train_step(model, off, s, 1)
        off.step()
        off.zero_grad()
    train_step(model, off, 2, 1)
    if clip is not None:
        off.clip_grad_norm_(clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if end == "step":
            off.step()
            off.close()
        else:
            del off, opt
            gc.collect()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, [str(w.message) for w in caught]


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "half_on_the_device"])
def test_an_optimizer_dropped_after_the_last_backward_completes_the_step_as_close_does(gpu_state, clip):
    """An optimizer garbage-collected after a window's last backward, without step(): the
    finalizer only let the worker finish, so the host records kept their speculative update (not
    redone with a clipping factor) and the device records took none: the model was left half
    updated, the split deciding which half, with no word. It now closes the window as close()
    does, with its warning."""
    want, _ = _weights_after_a_window_without_step(gpu_state, clip, "step")
    got, warned = _weights_after_a_window_without_step(gpu_state, clip, "drop")
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert [w for w in warned if "dropping the optimizer without step()" in w]


def test_a_ctrl_c_while_a_dropped_optimizer_closes_its_window_lets_it_close(monkeypatch):
    """A SIGINT while the garbage collector closes a dropped optimizer's window: close()
    re-raises it with the window open, for close() to be called again, which no one can do
    for a dropped optimizer. It is held back until the window is closed."""
    want, _ = _weights_after_a_window_without_step(HALF_STATE, 1e-3, "step")
    real = FullCPUOffloadOptimizer._close

    def interrupted(self, call):  # before it lands the last step and closes the window
        signal.raise_signal(signal.SIGINT)
        return real(self, call)

    monkeypatch.setattr(FullCPUOffloadOptimizer, "_close", interrupted)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    got, _ = _weights_after_a_window_without_step(HALF_STATE, 1e-3, "drop")
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert [u for u in unraisable if isinstance(u.exc_value, KeyboardInterrupt)]  # delivered, once closed


def test_an_optimizer_released_in_a_reference_cycle_after_the_last_backward_says_its_step_was_not_completed():
    """In a reference cycle the finalizer runs before __del__, and it cannot close the window
    (it holds no reference to the optimizer): it warns that the step was not completed."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=HALF_STATE, **SMALL)
    train_step(model, off, 0, 1)
    off.cycle = [off]
    with pytest.warns(RuntimeWarning, match="released after a window's last backward pass without step.*not completed"):
        del off, opt
        gc.collect()
