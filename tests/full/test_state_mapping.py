# opt.state of full offload: one persistent mapping, O(1) per lookup, whose
# per-parameter entries write through into the host state between steps. The step count is
# one live tensor, as torch's: an in-place edit counts like an assignment (refused loudly
# where the window's step already ran), and an uncloned state_dict() stays the live state.
import copy
import time
import warnings

import pytest
import torch
import torch.nn as nn

import cpu_offload
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload.reference import adamw_reference_
from cpu_offload._full.grad_norms import clip_coefficient
from helpers import (HALF_STATE, SMALL, assert_same_state, batches, build, capture, check_stepped_once, clone_tree, named,
                     sigint_at_line, snapshot, through_torch_save, train_step)


def _full(params, **options):
    return cpu_offload.offload_optimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), offload="full",
                                         pinned_bytes=1 << 16, num_slots=2, **options)


def test_state_lookup_is_constant_time_with_10000_parameters():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4)) for _ in range(10_000)]
    opt = _full(params)
    try:
        state = opt.state
        assert state is opt.state  # built once, not per access
        t0 = time.perf_counter()
        for p in params[:2000]:
            assert opt.state[p]["exp_avg"].shape == (4,)
        per_access_ms = (time.perf_counter() - t0) / 2000 * 1e3
        print(f"opt.state[p]['exp_avg'] with 10,000 parameters: {per_access_ms:.4f} ms per access")
        assert per_access_ms < 1.0
        assert len(opt.state) == 10_000 and all(p in opt.state for p in params[:10])
    finally:
        opt.close()


def test_state_entries_write_through_between_steps_and_refuse_inside_a_window():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = _full(model.parameters(), grad_accum_steps=2)
    try:
        w = model[0].weight
        entry = opt.state[w]
        m = torch.randn(16, 8)
        entry["exp_avg"] = m.clone()
        assert torch.equal(opt.state[w]["exp_avg"], m) and torch.equal(opt.state_dict()["state"][0]["exp_avg"], m)
        master = torch.randn(16, 8)
        entry["master"] = master
        assert torch.equal(opt.state[w]["master"], master)
        assert torch.equal(w.detach(), master.to(torch.bfloat16))  # compute copy == round(master)
        entry["step"] = torch.tensor(7.0)
        assert int(opt.state[w]["step"]) == 7 and int(opt.state_dict()["state"][0]["step"]) == 7
        opt.state[w] = opt.state[w]  # what Lightning does: a no-op
        assert torch.equal(opt.state[w]["master"], master)
        with pytest.raises(ValueError, match=r"opt.state\[.*\]\['exp_avg'\].*shape"):
            entry["exp_avg"] = torch.zeros(3)
        with pytest.raises(KeyError, match="keeps"):
            entry["momentum_buffer"] = torch.zeros(16, 8)
        with pytest.raises(KeyError, match="not a parameter of this full-offload optimizer"):
            opt.state[nn.Parameter(torch.zeros(2))]
        model(torch.randn(3, 8).to(torch.bfloat16)).float().sum().backward()  # 1 of 2: accumulating
        with pytest.raises(RuntimeError, match="after step"):
            entry["exp_avg"] = m
        opt.step()
        entry["exp_avg"] = m  # between steps again
        assert torch.equal(opt.state[w]["exp_avg"], m)
    finally:
        opt.close()


@pytest.mark.parametrize("step", [float("inf"), torch.tensor(float("inf")), torch.tensor(1e20), 2.0**63, 2**63 - 1, 2**62],
                         ids=["inf", "tensor(inf)", "tensor(1e20)", "2.0**63", "2**63-1", "2**62"])
def test_a_step_count_out_of_range_is_refused_naming_the_entry_and_changes_nothing(step):
    """inf raised a bare OverflowError naming neither the entry nor the parameter; a count
    beyond int64 was taken and the next backward failed in the worker. Both ways in refuse
    it with a ValueError naming both; the largest count accepted still trains."""
    torch.manual_seed(3)
    model = nn.Linear(4, 3)
    opt = _full(model.parameters())
    w, x = model.weight, torch.randn(2, 4).to(torch.bfloat16)
    try:
        opt.state[w]["step"] = 5
        saved = copy.deepcopy(opt.state_dict())
        saved["state"][0]["step"] = step
        with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\]\['step'\] \(param_groups\[0\]\[0\]\) must be "
                                             r"a non-negative whole number"):
            opt.load_state_dict(saved)
        with pytest.raises(ValueError, match=r"opt.state\[param_groups\[0\]\[0\]\]\['step'\] \(param_groups\[0\]\[0\]\) "
                                             r"must be a non-negative whole number"):
            opt.state[w]["step"] = step
        assert float(opt.state[w]["step"]) == 5
        model(x).float().sum().backward()
        opt.step()
        assert float(opt.state[w]["step"]) == 6
        opt.state[w]["step"] = 2**62 - 1  # the largest count accepted
        model(x).float().sum().backward()
        opt.step()
        assert float(opt.state[w]["step"]) == 2.0**62
    finally:
        opt.close()


@pytest.mark.parametrize("bad_key,bad,error", [("exp_avg_sq", torch.ones(3), ValueError),
                                               ("step", float("nan"), ValueError), ("master", [0.0], TypeError),
                                               ("exp_avg_sq", torch.zeros(2, 4, device="meta"), ValueError),
                                               ("master", torch.zeros(2, 4, device="meta"), ValueError)])
def test_assigning_an_entry_with_one_bad_key_changes_nothing(bad_key, bad, error):
    """``opt.state[p] = {...}`` wrote key by key: a bad later key raised, but the keys before it
    were already written. Every key is checked first now, as load_state_dict does."""
    torch.manual_seed(4)
    model = nn.Linear(4, 2)
    opt = _full(model.parameters())
    w = model.weight
    try:
        before = {key: value.clone() for key, value in opt.state[w].items()}
        compute = w.detach().clone()
        new = {"exp_avg": torch.randn(2, 4), "exp_avg_sq": torch.rand(2, 4), "step": 5, "master": torch.randn(2, 4)}
        new[bad_key] = bad
        with pytest.raises(error, match=rf"opt.state\[param_groups\[0\]\[0\]\]\['{bad_key}'\]"):
            opt.state[w] = new
        for key, value in before.items():
            assert torch.equal(opt.state[w][key], value), key
        assert torch.equal(w.detach(), compute)
        new[bad_key] = before[bad_key]
        opt.state[w] = new  # all good: every key written
        for key, value in new.items():
            assert torch.equal(opt.state[w][key], torch.as_tensor(value, dtype=torch.float32)), key
    finally:
        opt.close()


def test_replacing_the_state_is_refused_saying_how_to_reset_it():
    """``opt.state = defaultdict(dict)`` (a reset in torch) raised AttributeError: "property
    'state' ... has no setter". The host state is fixed at construction: a TypeError says how
    to reset an entry, and that way works."""
    from collections import defaultdict

    model = nn.Linear(8, 4)
    opt = _full(model.parameters())
    try:
        model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        with pytest.raises(TypeError, match=r"opt.state cannot be replaced under full offload.*'step'\] = 0"):
            opt.state = defaultdict(dict)
        w = model.weight
        opt.state[w]["exp_avg"].zero_()
        opt.state[w]["exp_avg_sq"].zero_()
        opt.state[w]["step"] = 0
        sd = opt.state_dict()["state"][0]
        assert int(sd["step"]) == 0 and not sd["exp_avg"].any() and not sd["exp_avg_sq"].any()
    finally:
        opt.close()


def test_a_frozen_parameter_reads_as_no_state_like_torch():
    """``opt.state[p]`` of a frozen parameter of the groups raised KeyError; torch's AdamW
    gives an empty entry. Writing state to it is refused: full offload never steps it."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight
    opt = _full(model.parameters())
    try:
        torch_opt = torch.optim.AdamW(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the frozen weight stays fp32
            model(torch.randn(3, 8)).float().sum().backward()
        opt.step()
        for state in (opt.state, torch_opt.state):
            entry = state[frozen]
            assert len(entry) == 0 and "exp_avg" not in entry and list(entry) == []
            with pytest.raises(KeyError):
                entry["step"]
        assert frozen not in opt.state and len(opt.state) == 3
        with pytest.raises(TypeError, match="frozen .* when the optimizer was wrapped"):
            opt.state[frozen]["exp_avg"] = torch.zeros(16, 8)
        with pytest.raises(TypeError, match="frozen .* when the optimizer was wrapped"):
            opt.state[frozen] = {"exp_avg": torch.zeros(16, 8)}
        assert len(opt.state_dict()["state"]) == 3
    finally:
        opt.close()


@pytest.mark.parametrize("k", [1, 2])
def test_state_reads_after_the_windows_last_backward_began_raise_until_step(k):
    """opt.state read between the window's last backward and step() gave the values after the
    step (full offload applies it during that backward), where torch's optimizer shows those
    before it, and an in-place write through it acted on the stepped state: refused now, as
    assignment is. In the middle of an accumulation window a read is torch's and allowed."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = _full(model.parameters(), grad_accum_steps=k)
    w, x = model[0].weight, torch.randn(3, 8).to(torch.bfloat16)
    try:
        model(x).float().sum().backward()
        if k == 2:  # the middle of the window: nothing stepped yet
            assert float(opt.state[w]["step"]) == 0 and not opt.state[w]["exp_avg"].any()
            seen = {}

            def peek(_):  # a read inside the window's last backward
                with pytest.raises(RuntimeError, match="in a backward pass: full offload applies"):
                    opt.state[w]["exp_avg"]
                seen["hook"] = True

            handle = model[2].weight.register_hook(peek)
            model(x).float().sum().backward()
            handle.remove()
            assert seen
        for key in ("step", "master", "exp_avg", "exp_avg_sq"):
            with pytest.raises(RuntimeError, match=rf"reading opt.state\[.*\]\['{key}'\] after the window's last "
                                                   r"backward pass, before step\(\): .* call it after step\(\)"):
                opt.state[w][key]
        opt.step()
        assert float(opt.state[w]["step"]) == 1 and opt.state[w]["exp_avg"].any()
    finally:
        opt.close()


def test_state_reads_after_step_land_the_overlapped_step_first(monkeypatch):
    """With overlap_forward, step() returns while the worker still steps the last chunks: a
    read of opt.state then gave the state before the step (step count one short) without a
    word, and a write through it was overwritten by the step. A read lands the step first."""
    from helpers import Gate, batches, build

    gate = Gate(monkeypatch)
    model, opt = build("adamw")
    off = cpu_offload.offload_optimizer(opt, offload="full", overlap_forward=model, pinned_bytes=1 << 20, num_slots=8)
    w = model.l1.weight
    try:
        for s in range(3):
            ((x, extra),) = batches(s, 1)
            loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
            if s == 2:
                off.wait_for_weights()
                gate.close()  # the last step's kernels wait until something waits for them
            loss.backward()
            off.step()
            off.zero_grad()
        assert off._proto.landing  # step() returned with the step in flight
        entry = off.state[w]
        assert float(entry["step"]) == 3
        entry["exp_avg"].zero_()  # a moment reset after step(), through the view
        off.wait_for_weights()
        assert float(off.state[w]["step"]) == 3 and not off.state[w]["exp_avg"].any()
    finally:
        off.close()


# ------------------------------------------------ step counts: live tensors, as torch's

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
EDITED = 10  # the count written in place


def _net():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _x(s, m):
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * s + m))


def _train_with_an_edit(offload, k, edit_at, windows=4):
    """``windows`` windows of ``k`` backward passes; before pass ``edit_at`` (window, pass)
    the first weight's step tensor is written in place. Returns the weights, the count read
    back after the edit and after each step, and each window's gradients per pass."""
    model = _net()
    grads = {}
    for n, p in model.named_parameters():  # NOTE: registered first: runs before the offload hook
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.setdefault(n, []).append(p.grad.detach().clone()))
    opt = torch.optim.AdamW(model.parameters(), **HP)
    if offload:
        opt = cpu_offload.offload_optimizer(opt, offload="full", grad_accum_steps=k, compute_dtype=torch.float32,
                                            pinned_bytes=1 << 16, num_slots=2)
    w = model[0].weight
    counts, history = [], []
    try:
        for s in range(windows):
            grads.clear()
            for m in range(k):
                if (s, m) == edit_at:
                    step = opt.state[w]["step"]
                    with torch.no_grad():
                        step.fill_(float(EDITED))
                    counts.append(float(opt.state[w]["step"]))
                model(_x(s, m)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            counts.append(float(opt.state[w]["step"]))
            history.append({n: list(g) for n, g in grads.items()})
        if offload:
            entry, saved = opt.state[w], opt.state_dict()["state"][0]
            assert entry["step"] is entry["step"] and saved["step"] is entry["step"]  # one live tensor, as torch's
            assert saved["master_step"] is not saved["step"] and float(saved["master_step"]) == float(saved["step"])
    finally:
        if offload:
            opt.close()
    return [p.detach().clone() for p in model.parameters()], counts, history


def _replay(history, edited_window):
    """The reference AdamW over the captured gradients (summed in arrival order, as the host
    accumulator), the first weight's count set to EDITED before window ``edited_window``."""
    model = _net()
    state = {n: [0, torch.zeros_like(p), torch.zeros_like(p)] for n, p in model.named_parameters()}
    for s, grads in enumerate(history):
        if s == edited_window:
            state["0.weight"][0] = EDITED
        for n, p in model.named_parameters():
            total = grads[n][0].clone()
            for g in grads[n][1:]:
                total += g
            state[n][0] += 1
            with torch.no_grad():
                adamw_reference_(p, total, state[n][1], state[n][2], state[n][0], lr=HP["lr"], beta1=HP["betas"][0],
                                 beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("k, edit_at", [(1, (2, 0)), (2, (2, 0)), (2, (2, 1))],
                         ids=["between steps", "between windows, k=2", "between the two backwards"])
def test_a_step_count_edited_in_place_is_the_count_the_step_takes_as_torch(k, edit_at):
    """``opt.state[p]["step"]`` was a new tensor per read: writing into it in place was
    ignored without a word, where torch's step counts from it (read back 10, then 11 after
    the step; here 1, then 2, and the weights differed by 3.5e-3). It is now one live tensor
    whose edit is taken before the count is next used: the counts read back are torch's,
    the weights the reference's with the edited count, bit for bit."""
    got, got_counts, history = _train_with_an_edit(True, k, edit_at)
    want, want_counts, _ = _train_with_an_edit(False, k, edit_at)
    assert got_counts == want_counts, (got_counts, want_counts)
    for a, b in zip(got, _replay(history, edit_at[0])):
        assert torch.equal(a, b)
    for a, b in zip(got, want):  # torch's kernel rounds differently: the same steps, to a few ulps
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:cpu_offload. zero_grad.. without step")
@pytest.mark.parametrize("call", ["step", "zero_grad"])
@pytest.mark.parametrize("k", [1, 2])
def test_a_step_count_edited_after_the_windows_last_backward_raises_and_is_undone(k, call):
    """The window's last backward already stepped with the count as it was: an edit of the
    step tensor after it cannot be the count that step used. step() (or zero_grad(), which
    keeps that update) finishes the step, writes the step's count back and raises naming the
    parameter; the state is the step's exact result and training goes on."""
    twin_model, model = _net(), _net()
    twin, opt = (_full(m.parameters(), grad_accum_steps=k, compute_dtype=torch.float32) for m in (twin_model, model))
    step = opt.state[model[0].weight]["step"]  # held from the start
    try:
        for s in range(2):
            for m in range(k):
                for net in (twin_model, model):
                    net(_x(s, m)).pow(2).mean().backward()
            if s == 1:
                with torch.no_grad():
                    step.fill_(float(EDITED))
                with pytest.raises(RuntimeError, match=r"step counts of \['param_groups\[0\]\[0\]'\] \(opt.state"
                                                       rf".*changed in place after the window's last backward pass "
                                                       rf"and before {call}\(\).*undone"):
                    getattr(opt, call)()
            else:
                opt.step()
            twin.step()
            for o in (twin, opt):
                o.zero_grad()
        assert float(step) == 2 and step is opt.state[model[0].weight]["step"]
        assert_same_state(snapshot(twin), snapshot(opt))
        for net in (twin_model, model):
            net(_x(2, 0)).pow(2).mean().backward()
        for o in (twin, opt):
            o.step()
        assert_same_state(snapshot(twin), snapshot(opt))
    finally:
        twin.close()
        opt.close()


@pytest.mark.filterwarnings("ignore:cpu_offload. backward pass 1 of 1 raised")
@pytest.mark.parametrize("bad", [-1.0, 1.5, float("nan")], ids=["-1", "1.5", "nan"])
@pytest.mark.parametrize("where", ["next backward", "step() of a short window"])
def test_a_bad_step_count_edited_in_place_raises_naming_the_entry_and_changes_nothing(where, bad):
    """A count written in place is checked as an assignment is, when it is taken: a bad one
    raises a ValueError naming the entry before anything changes; set right, training goes on."""
    model = _net()
    opt = _full(model.parameters(), grad_accum_steps=2 if where.startswith("step") else 1)
    w, x = model[0].weight, _x(0, 0).to(torch.bfloat16)
    try:
        if where == "next backward":
            model(x).float().sum().backward()
            opt.step()
            opt.zero_grad()
        else:
            model(x).float().sum().backward()  # 1 of 2 passes
        before, weights = snapshot(opt), [p.detach().clone() for p in model.parameters()]
        step = opt.state[w]["step"]
        count = float(step)
        with torch.no_grad():
            step.fill_(bad)
        with pytest.raises(ValueError, match=r"opt.state\[param_groups\[0\]\[0\]\]\['step'\] .*must be a "
                                             r"non-negative whole number"):
            if where == "next backward":
                model(x).float().sum().backward()
            else:
                opt.step()
        assert_same_state(before, snapshot(opt))
        assert all(torch.equal(a, p.detach()) for a, p in zip(weights, model.parameters()))
        with torch.no_grad():
            step.fill_(count)
        if where == "next backward":
            opt.zero_grad()  # the backward that raised is dropped
            model(x).float().sum().backward()
        opt.step()
        assert float(opt.state[w]["step"]) == count + 1
    finally:
        opt.close()



def _wrapped(gpu_state):
    model, opt = build("adamw")
    return model, FullCPUOffloadOptimizer(opt, gpu_state=gpu_state, **SMALL)


@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "split"])
def test_an_uncloned_state_dict_is_the_live_state_as_torchs(gpu_state):
    """state_dict() gave live views of the masters and moments but new tensors of the step
    counts: taken at step 2 and loaded after step 5 (the same optimizer, or a fresh one), it
    paired step-5 moments with count 2 without a word (the count went back to 2; the resume
    differed by 8.8e-4). Every entry is live now, as torch's: the reload changes nothing, a
    fresh wrapper resumes bit for bit, and the dict saved after step 5 holds step 5 whole."""
    def train(model, off, steps):
        for s in steps:
            ((x, extra),) = batches(s, 1)
            model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
            off.step()
            off.zero_grad()

    def state_of(model, off):
        return {n: (r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), r.step, r.param.detach().clone())
                for n, r in named(model, off).items()}

    runs = []
    try:
        model_a, a = _wrapped(gpu_state)
        runs.append(a)
        train(model_a, a, range(7))  # not interrupted
        model, off = _wrapped(gpu_state)
        runs.append(off)
        train(model, off, range(2))
        sd = off.state_dict()
        train(model, off, range(2, 5))
        saved = through_torch_save(sd)
        for rec in named(model, off).values():
            entry = saved["state"][rec.index]
            assert float(entry["step"]) == float(entry["master_step"]) == rec.step
            assert torch.equal(entry["master"].reshape(-1), rec.master.cpu())
        before = state_of(model, off)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            off.load_state_dict(sd)
        assert_same_state(before, state_of(model, off))
        resumed = [(model, off)]
        for source in (sd, saved):  # NOTE: sd is off's live state: loaded before off trains on
            model_c, c = _wrapped(gpu_state)
            runs.append(c)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                c.load_state_dict(source)
            resumed.append((model_c, c))
        for model_c, c in resumed:
            train(model_c, c, range(5, 7))
            assert_same_state(state_of(model_a, a), state_of(model_c, c))
    finally:
        for o in runs:
            o.close()


@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "split"])
def test_pickling_or_copying_opt_state_gives_a_snapshot_as_torchs(gpu_state):
    """``pickle.dumps(opt.state)`` failed on a lambda inside the mapping. torch's ``opt.state``
    pickles and deep-copies as a dict of the entries; full offload's now gives the same: a
    snapshot ``{param: {key: tensor}}`` whose tensors are copies, not the live host state."""
    import io
    import pickle

    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, gpu_state=gpu_state, **SMALL)
    try:
        for s in range(2):
            ((x, extra),) = batches(s, 1)
            model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
            off.step()
            off.zero_grad()
        live = {p: {k: v.clone() for k, v in entry.items()} for p, entry in off.state.items()}
        buffer = io.BytesIO()
        torch.save(off.state, buffer)
        buffer.seek(0)
        copies = [pickle.loads(pickle.dumps(off.state)), copy.deepcopy(off.state),
                  torch.load(buffer, weights_only=False)]
        for snap in copies:
            assert type(snap) is dict and len(snap) == len(live)
            for (p, entry), (q, values) in zip(live.items(), snap.items()):
                assert torch.equal(q.detach(), p.detach()) and type(values) is dict
                assert list(values) == list(entry) == ["step", "master", "exp_avg", "exp_avg_sq"]
                for key, value in entry.items():
                    assert torch.equal(values[key], value), key
        p0 = next(iter(live))
        for snap in copies:  # copies, not views of the host state
            next(iter(snap.values()))["exp_avg"].add_(1.0)
        assert torch.equal(off.state[p0]["exp_avg"], live[p0]["exp_avg"])
    finally:
        off.close()


@pytest.mark.parametrize("first_read", ["state_dict", "state step"])
def test_step_counts_first_handed_out_in_inference_mode_train_on_as_torch(first_read):
    """An evaluation that kept ``opt.state_dict()`` (a best checkpoint held in memory) or read
    ``opt.state[p]["step"]`` under ``torch.inference_mode()`` got step tensors made there:
    inference tensors, which every later ``step()`` and ``state_dict()`` failed to update
    ("Inplace update to inference tensor outside InferenceMode"), naming neither cause nor
    library, and whose in-place edit failed; torch's AdamW trains on. Here the run equals
    the one without that evaluation, bit for bit, and the kept counts are live."""
    results = []
    for evaluate in (True, False):
        model, opt = build("adamw")
        off = cpu_offload.offload_optimizer(opt, offload="full", pinned_bytes=1 << 16, num_slots=2)
        try:
            train_step(model, off, 0, 1)
            off.step()
            off.zero_grad()
            if evaluate:
                with torch.inference_mode():
                    kept = off.state_dict() if first_read == "state_dict" else off.state[model.l1.weight]["step"]
            for s in range(1, 3):
                train_step(model, off, s, 1)
                off.step()
                off.zero_grad()
            saved = off.state_dict()
            if evaluate:
                step = kept["state"][0]["step"] if first_read == "state_dict" else kept
                assert int(step) == 3 and not step.is_inference()
                off.state[model.l1.weight]["step"].fill_(3)  # an in-place edit as the docs allow
            results.append((snapshot(off), int(saved["state"][0]["master_step"])))
        finally:
            off.close()
    assert results[0][1] == results[1][1] == 3
    assert_same_state(results[0][0], results[1][0])


def _edit(master):
    """The edit a test writes into a master: new values for every element."""
    return master * 0.5 + 0.01


_WRITES = {
    "copy_ into opt.state": lambda opt, w, rec: opt.state[w]["master"].copy_(_edit(rec.master.view(rec.shape))),
    "mul_ and add_ of state_dict()'s": lambda opt, w, rec: opt.state_dict()["state"][rec.index]["master"].mul_(0.5)
    .add_(0.01),
    "into a view of it": lambda opt, w, rec: opt.state[w]["master"].view(-1)[:].copy_(_edit(rec.master)),
}


@pytest.mark.filterwarnings("ignore:cpu_offload. backward pass")
@pytest.mark.parametrize("write", list(_WRITES))
@pytest.mark.parametrize("k, edit_at", [(1, 0), (2, 0), (2, 1)], ids=["k=1", "k=2, pass 0", "k=2, pass 1"])
def test_a_master_written_in_place_is_taken_and_the_backward_after_it_raises(k, edit_at, write):
    """A master written in place (``opt.state[p]["master"].copy_(t)``) was not seen by the weight:
    the forward and backward after it read the old weight without a word, and the step updated the
    written master with that weight's gradient. The backward after it now raises naming the
    parameter, having taken the master (the weight is round(master)); the window run again equals
    the run that assigned the master, bit for bit."""
    runs = {}
    for how in ("assigned", "in place"):
        model = _net()
        opt = _full(model.parameters(), grad_accum_steps=k, compute_dtype=torch.float32)
        w = model[0].weight
        rec = next(r for r in opt._records if r.param is w)
        try:
            for s in range(3):
                if s == 1 and how == "assigned":
                    opt.state[w]["master"] = _edit(rec.master.view(rec.shape))
                for m in range(k):
                    if (s, m) == (1, edit_at) and how == "in place":
                        with torch.no_grad():
                            _WRITES[write](opt, w, rec)
                        assert not torch.equal(w.detach(), rec.master.view(rec.shape))  # the weight is stale
                        with pytest.raises(RuntimeError, match=r"masters of \['param_groups\[0\]\[0\]'\] "
                                                               r"\(opt.state\[p\]\['master'\]\) were written in place"):
                            model(_x(s, m)).pow(2).mean().backward()
                        assert torch.equal(w.detach(), rec.master.view(rec.shape))  # taken: round(master)
                        opt.zero_grad()  # the window is run again from its first pass
                        for m2 in range(k):
                            model(_x(s, m2)).pow(2).mean().backward()
                        break
                    model(_x(s, m)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            runs[how] = snapshot(opt), [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
    assert_same_state(runs["assigned"][0], runs["in place"][0])
    assert all(torch.equal(a, b) for a, b in zip(runs["assigned"][1], runs["in place"][1]))


@pytest.mark.parametrize("limit, clip_at_step, close", [(1e6, 1e6, "step"), (1e6, 1e-3, "step"), (1e-3, 1e-3, "step"),
                                                      (1e6, None, "zero_grad")],
                         ids=["stepped in backward", "redone at step()", "held back", "dropped by zero_grad()"])
def test_a_master_written_in_place_after_the_last_backward_is_kept_and_said(limit, clip_at_step, close):
    """A master written in place (through a tensor taken before) between the window's last
    backward and step(): where the step was held back (it clips, the limit known from the steps
    before), step() updates the written master, as torch's would. Where it ran during backward,
    it cannot: step() keeps the written master over the step's rollback or redo, writes the
    weight from it and raises saying so (the moments and count are the step's); zero_grad()
    keeps it as torch's would, and says nothing more than that the update was applied. Before,
    a redo at step() stepped the written master back and forth, and the next backward raised
    that its forward read an old weight."""
    model = _net()
    grads = capture(model)
    opt = _full(model.parameters())
    w = model[0].weight
    rec = next(r for r in opt._records if r.param is w)
    try:
        for s in range(2):  # NOTE: clipped steps teach the clipping limit
            model(_x(s, 0).to(torch.bfloat16)).float().pow(2).mean().backward()
            opt.clip_grad_norm_(limit)
            opt.step()
            opt.zero_grad()
        held = opt.state[w]["master"]
        before = snapshot(opt)
        grads.clear()
        model(_x(2, 0).to(torch.bfloat16)).float().pow(2).mean().backward()
        assert opt._pipeline.held_back == (limit < 1)
        written = torch.randn(held.shape, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            held.copy_(written)
        if close == "zero_grad":
            with pytest.warns(RuntimeWarning, match="zero_grad\\(\\) without step\\(\\)"):
                opt.zero_grad()
        else:
            coef = clip_coefficient(clip_at_step, float(opt.clip_grad_norm_(clip_at_step)))
            if limit < 1:
                opt.step()
                before[rec.name] = (written.reshape(-1),) + before[rec.name][1:]
                check_stepped_once(model, opt, before, grads, coef, "held back")
            else:
                with pytest.raises(RuntimeError, match=r"were written in place after the window's last backward pass"):
                    opt.step()
            opt.zero_grad()
        if limit > 1:
            assert torch.equal(rec.master, written.reshape(-1)) and rec.step == before[rec.name][3] + 1
        assert torch.equal(w.detach(), rec.master.view(rec.shape).to(w.dtype))
        model(_x(3, 0).to(torch.bfloat16)).float().pow(2).mean().backward()  # no error: nothing is stale
        opt.step()
    finally:
        opt.close()


def test_a_ctrl_c_while_a_master_written_after_the_last_backward_is_kept_ends_as_without_it(sigint_raises):
    """step() keeps masters written after their step inside its deferred-interrupt block: a
    Ctrl-C at any line of that is raised with step()'s error once every master is kept and its
    weight written, so the run goes on as without it."""
    def run(k):
        model = _net()
        opt = _full(model.parameters())
        held = [opt.state[p]["master"] for p in (model[0].weight, model[2].weight)]
        model(_x(0, 0).to(torch.bfloat16)).float().pow(2).mean().backward()
        with torch.no_grad():
            for h in held:
                h.mul_(0.5)
        if k is None:
            with pytest.raises(RuntimeError, match="written in place after"):
                opt.step()
        else:
            hit, raised = sigint_at_line(k, opt.step, start="_keep_masters_written")
            if not hit:
                opt.close()
                return None
            assert isinstance(raised, (KeyboardInterrupt, RuntimeError)), (k, raised)
            assert isinstance(raised, KeyboardInterrupt) or isinstance(raised.__context__, KeyboardInterrupt), k
        opt.zero_grad()
        model(_x(1, 0).to(torch.bfloat16)).float().pow(2).mean().backward()  # no error: nothing is stale
        opt.step()
        state = snapshot(opt), [p.detach().clone() for p in model.parameters()]
        opt.close()
        return state

    want, k = run(None), 0
    while (got := run(k + 1)) is not None:
        k += 1
        assert_same_state(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])), k
    assert k > 10, k


@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "split"])
def test_masters_held_over_rollbacks_and_loads_or_loaded_in_place_with_their_weights_raise_nothing(gpu_state):
    """The library's own writes of the masters (a clipped step's redo, a non-finite gradient's
    rollback, a load) and a master written in place together with its weight (torch DCP's
    in-place load of a model's and an optimizer's state dicts) are no stale weights: held
    opt.state and state_dict() masters train on as without them, with no error."""
    def train(model, off, steps):
        for s in steps:
            ((x, extra),) = batches(s, 1)
            loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
            (loss * (float("nan") if s == 3 else 1.0)).backward()  # a rollback at step 3
            off.clip_grad_norm_(1e-3)  # a redo at every step
            off.step()
            off.zero_grad()

    runs = []
    try:
        (model_a, a), (model_b, b) = _wrapped(gpu_state), _wrapped(gpu_state)
        runs += [a, b]
        held = [b.state_dict()] + [b.state[p]["master"] for p in model_b.parameters() if p.requires_grad]
        for model, off in ((model_a, a), (model_b, b)):
            train(model, off, range(5))
            off.load_state_dict(through_torch_save(off.state_dict()))
            train(model, off, range(5, 6))
        assert_same_state(snapshot(a), snapshot(b))
        saved, weights = through_torch_save(a.state_dict()), clone_tree(model_a.state_dict())
        train(model_a, a, range(6, 8))
        with torch.no_grad():  # as DCP's load in place: the weights and the masters, no load_state_dict()
            for name, p in model_a.named_parameters():
                p.copy_(weights[name])
            for index, entry in a.state_dict()["state"].items():
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    entry[key].copy_(saved["state"][index][key])
                entry["step"].copy_(saved["state"][index]["step"])
        train(model_a, a, range(6, 8))
        train(model_b, b, range(6, 8))
        assert_same_state(snapshot(a), snapshot(b))
        del held
    finally:
        for o in runs:
            o.close()


@pytest.mark.parametrize("change", ["cast to fp32", "tied to another weight"])
def test_a_weight_changed_so_that_it_is_refused_is_refused_when_its_master_was_also_written(change):
    """The check for masters written in place runs first in a backward, and writing the weight
    from the master noted the weight's new dtype and storage as the library's: a weight cast
    after wrapping (``model.float()``), or tied to another one, was then trained on without
    the refusals it gets alone. They raise as without the master's write."""
    model = _net()
    opt = _full(model.parameters())
    a, b = model[0].weight, model[2].weight
    try:
        model(_x(0, 0).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if change == "cast to fp32":
            model.float()
            error, match = TypeError, r"compute copy of param_groups\[0\]\[0\] is now torch.float32"
        else:
            b.data = a.data.view(-1)[: b.numel()].view_as(b)
            error, match = ValueError, r"share memory"
        with torch.no_grad():
            opt.state[a]["master"].mul_(0.5)
        for _ in range(2):  # and again: the refusal stays
            with pytest.raises(error, match=match):
                model(_x(0, 1).to(a.dtype)).float().pow(2).mean().backward()
            opt.zero_grad()
    finally:
        opt.close()
