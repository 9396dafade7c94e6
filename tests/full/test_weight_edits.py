# Weights changed in place by the user while a full-offload window is open: between two
# backward passes of an accumulation window, after the last pass of a short window, after
# the last backward of a window that holds its step back until step(), and after the last
# backward whose chunks were already stepped. torch's step() updates whatever the weights
# are when it runs; full offload must give that, bit for bit against reference.py, or
# refuse loudly where its step already ran.
#
# Scope: host records on CPU parameters, without and with FSDP2 (one gloo rank).
# Device records: tests/full/test_gpu_state.py; edits between steps: test_fsdp_cpu.py.

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from helpers import (SMALL, assert_bit_equal, batches, build, capture, check_stepped_once, named, sigint_at_line,
                     snapshot, train_step)

EDITED = ("l2.weight", "l1.bias")


def backward_pass(model, s, m, k, *, loss_factor=1.0):
    x, extra = batches(s, k)[m]
    (model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean() * loss_factor).backward()


def edit(model, names=EDITED, *, seed=3):
    """Change every element of each named weight in place to a fresh random bf16 value (one
    equal to the weight it replaces is moved up by one); return them."""
    params, g = dict(model.named_parameters()), torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for n in names:
            value = torch.randn(params[n].shape, generator=g).to(params[n].dtype)
            same = value == params[n]
            value[same] = (value[same].float() + 1).to(value.dtype)
            values[n] = value
            params[n].copy_(value)
    return values


def with_masters(before, off, model, values):
    """``snapshot`` ``before`` with the masters of the edited parameters set to their edited values."""
    out = dict(before)
    for n, v in values.items():
        rec = named(model, off)[n]
        _, exp_avg, exp_avg_sq, step = before[rec.name]
        out[rec.name] = (v.float().reshape(-1), exp_avg, exp_avg_sq, step)
    return out


def names_in(message, off, model) -> set:
    """The parameters whose record names (``param_groups[g][i]``) ``message`` quotes."""
    return {n for n, rec in named(model, off).items() if repr(rec.name) in message}


def check_weights_are_rounded_masters(model, off):
    for n, rec in named(model, off).items():
        assert torch.equal(rec.param.detach().reshape(-1), rec.master.to(rec.param.dtype)), n


def warm_up(kind="adamw", k=2, **opts):
    model, opt = build(kind)
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, **SMALL, **opts)
    train_step(model, off, 0, k)
    off.step()
    off.zero_grad()
    grads.clear()
    return model, off, grads


@pytest.mark.parametrize("k", [1, 2])
def test_a_partial_edit_takes_the_elements_it_changed_and_keeps_the_others_fp32_bits(k):
    """An edit of part of a weight (a padding row kept at zero after each step,
    nn.Embedding(max_norm=...)'s in-place renormalisation, a mask) replaced the whole master by
    the compute copy: every element the edit did not touch lost its fp32 bits at each edit, and
    updates smaller than a bf16 step were rounded away for good. The master now takes the
    changed elements only: torch's step() on fp32 weights edited so, bit for bit."""
    model, off, grads = warm_up(k=k)
    rec = named(model, off)["l2.weight"]
    assert not torch.equal(rec.master, rec.master.to(torch.bfloat16).float())  # bits below bf16 to lose
    before = snapshot(off)
    for m in range(k):
        if m == k - 1:  # before the window's last pass: for k=2, between its two passes
            with torch.no_grad():
                model.l2.weight[0].zero_()
        backward_pass(model, 1, m, k)
    off.step()
    edited = before[rec.name][0].clone().view(model.l2.weight.shape)
    edited[0] = 0
    _, exp_avg, exp_avg_sq, step = before[rec.name]
    check_stepped_once(model, off, {**before, rec.name: (edited.reshape(-1), exp_avg, exp_avg_sq, step)}, grads, 1.0,
                       "a row zeroed")
    off.close()


@pytest.mark.parametrize("k", [1, 2])
def test_a_mask_that_zeroes_over_half_of_a_weight_keeps_the_kept_elements_fp32_bits(k):
    """Pruning applied after each step (``weight.mul_(mask)``) zeroes over half of a weight:
    as a change of over half of the tensor it was taken whole, and every kept element lost its
    fp32 bits at each edit. A change that sets only zeros and keeps nonzero elements is a mask,
    not a load: torch's step() on fp32 weights masked so, bit for bit (-0 where the sign was
    negative)."""
    model, off, grads = warm_up(k=k)
    rec = named(model, off)["l2.weight"]
    mask = torch.rand(model.l2.weight.shape, generator=torch.Generator().manual_seed(5)) < 0.25
    assert not torch.equal(rec.master, rec.master.to(torch.bfloat16).float())  # bits below bf16 to lose
    before = snapshot(off)
    for m in range(k):
        if m == k - 1:
            with torch.no_grad():
                model.l2.weight.mul_(mask)
        backward_pass(model, 1, m, k)
    off.step()
    master, exp_avg, exp_avg_sq, step = before[rec.name]
    masked = master.view(mask.shape) * mask
    assert (masked.signbit() & ~mask).any()  # -0 where the sign was negative
    check_stepped_once(model, off, {**before, rec.name: (masked.reshape(-1), exp_avg, exp_avg_sq, step)}, grads,
                       1.0, "three quarters zeroed")
    off.close()


def test_zeros_loaded_into_a_weight_are_taken_whole():
    """A tensor of zeros loaded over a weight is a load, not a mask: every master is +0 after
    it, also one so small that it rounded to +0 before."""
    model, off, _ = warm_up(k=1)
    rec = named(model, off)["l2.weight"]
    with torch.no_grad():
        rec.master[:2] = torch.tensor([1e-42, -1e-42])  # round to +0 and -0 in bf16
        model.l2.weight.view(-1)[:2] = rec.master[:2].to(torch.bfloat16)
    model.load_state_dict({**model.state_dict(), "l2.weight": torch.zeros_like(model.l2.weight)})
    off.state_dict()  # adopts the load
    assert torch.equal(rec.master, torch.zeros_like(rec.master)) and not rec.master.signbit().any()
    off.close()


def test_a_partial_edit_does_not_mark_the_masters_as_taken_from_weights():
    """A load of a checkpoint without masters warns when a tensor's masters came from weights
    loaded at bf16 since wrapping (they lack the low bits). A partial edit (a padding row
    zeroed) set the same mark, so the load warned for masters that had kept their fp32 bits."""
    model, off, _ = warm_up(k=1)
    torch_state = copy.deepcopy(off.state_dict())  # as a torch AdamW's: no masters
    for entry in torch_state["state"].values():
        del entry["master"], entry["master_step"]
    with torch.no_grad():
        model.l2.weight[0].zero_()
    off.state_dict()  # adopts the edit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off.load_state_dict(torch_state)
    assert not named(model, off)["l2.weight"].master[:model.l2.weight.shape[1]].any()
    off.close()


@pytest.mark.parametrize("how", ["whole tensor zeroed", "a row loaded"])
def test_only_nonzero_values_taken_from_bf16_weights_mark_the_masters(how):
    """A load of a checkpoint without masters warns where masters took nonzero values from
    bf16 weights since wrapping (they lack an fp32 checkpoint's low bits). Zeros carry no low
    bits: a mask that zeroes the whole tensor must not make it warn; a row of other weights
    loaded into the tensor (an edit of under half of it) must."""
    model, off, _ = warm_up(k=1)
    torch_state = copy.deepcopy(off.state_dict())  # as a torch AdamW's: no masters
    for entry in torch_state["state"].values():
        del entry["master"], entry["master_step"]
    with torch.no_grad():
        if how == "whole tensor zeroed":
            model.l2.weight.mul_(0)
        else:
            model.l2.weight[0] = torch.randn(model.l2.weight.shape[1]).to(torch.bfloat16)
    off.state_dict()  # adopts the edit
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        off.load_state_dict(torch_state)
    warned = [w for w in seen if "has no fp32 master" in str(w.message)]
    assert len(warned) == (how == "a row loaded")
    off.close()


def test_a_load_after_training_is_taken_whole_whichever_path_takes_it():
    """A model checkpoint loaded after training changes most elements of each tensor: the
    masters take all of it, also the elements loaded with the value their master already
    rounds to (element by element they would keep trained low bits). The optimizer's
    load_state_dict of a checkpoint without masters took whole tensors and the adoption
    between steps element by element, so an opt.state_dict() between the two loads (which
    adopts first) changed the masters: both follow one rule now."""
    runs = []
    for read_between in (False, True):
        model, off, _ = warm_up(k=1)
        saved = {n: v.clone() for n, v in model.state_dict().items()}
        torch_state = copy.deepcopy(off.state_dict())  # as a torch AdamW's: no masters
        for entry in torch_state["state"].values():
            del entry["master"], entry["master_step"]
        for s in (1, 2, 3):
            train_step(model, off, s, 1)
            off.step()
            off.zero_grad()
        trained = {n: rec.master.clone() for n, rec in named(model, off).items()}
        model.load_state_dict(saved)
        if read_between:
            off.state_dict()
        with pytest.warns(RuntimeWarning, match="has no fp32 master"):
            off.load_state_dict(torch_state)
        masters = {n: rec.master.clone() for n, rec in named(model, off).items()}
        coinciding = 0  # loaded with the value the trained master rounds to, and not equal to it
        for n in masters:
            loaded = saved[n].reshape(-1)
            if torch.equal(loaded, trained[n].to(loaded.dtype)):
                continue  # never trained (no gradient): nothing was loaded into it
            assert torch.equal(masters[n], loaded.float()), n
            coinciding += int(((loaded == trained[n].to(loaded.dtype)) & (trained[n] != loaded.float())).sum())
        assert coinciding > 0  # the case element-wise adoption would get wrong occurs
        runs.append(masters)
        off.close()
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


@contextlib.contextmanager
def swapping(on: bool):
    """Module loads and casts swap parameters (torch.utils.swap_tensors) while ``on``."""
    torch.__future__.set_swap_module_params_on_conversion(on)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def test_loads_that_swap_parameters_load_and_their_hooks_come_back():
    """With torch.__future__.set_swap_module_params_on_conversion(True), model.load_state_dict
    swaps each parameter (torch.utils.swap_tensors), which refuses a tensor that has a weak
    reference, and full offload's registry of owned parameters held one: the load raised
    torch's "Cannot swap t1 because it has weakref associated with it". It now loads. A swap
    drops the parameter's hooks (torch's behaviour): with every parameter swapped, the next
    window's gradients bypass full offload, and its step() says so and registers the hooks
    again, also where the new tensor got the old one's address (six swaps); a parameter
    swapped beside others that were not gets its hook back at the backward's first gradient,
    before its own arrives. Each run then trains as after loads that copy."""
    masters = []
    for swap in (False, True):
        model, off, _ = warm_up(k=1)
        for s in range(1, 7):
            halved = {n: v * 0.5 for n, v in model.state_dict().items()}
            with swapping(swap):
                model.load_state_dict(halved)
            if swap:
                train_step(model, off, s, 1)
                with pytest.raises(RuntimeError, match=r"reached param.grad without passing through full offload's "
                                                       r"hooks.*swap_tensors drops a tensor's hooks.*registered again "
                                                       r"for the next windows"):
                    off.step()
                off.zero_grad()
            train_step(model, off, s, 1)
            off.step()
            off.zero_grad()
        halved = {n: v * 0.5 for n, v in model.l1.state_dict().items()}
        with swapping(swap):  # the first layer only: its gradients arrive after the head's
            model.l1.load_state_dict(halved)
        train_step(model, off, 7, 1)
        off.step()
        masters.append({n: rec.master.clone() for n, rec in named(model, off).items()})
        off.close()
    assert masters[0].keys() == masters[1].keys()
    assert all(torch.equal(masters[0][n], masters[1][n]) for n in masters[0]), "swapped loads"


def test_a_swapped_parameter_keeps_the_mark_that_refuses_wrapping_its_bf16_copy_again():
    """A swap moves a parameter's attributes to the tensor it was swapped with, and with them
    the mark of its cast to bf16: after close(), a new full-offload optimizer took that bf16
    copy for its fp32 masters without a word, where one without the swap is refused. The hooks
    that come back bring the mark back."""
    model, off, _ = warm_up(k=1)
    with swapping(True):
        model.load_state_dict({n: v * 0.5 for n, v in model.state_dict().items()})
    train_step(model, off, 1, 1)
    with pytest.raises(RuntimeError, match="swap_tensors drops a tensor's hooks"):
        off.step()
    off.zero_grad()
    off.close()
    with pytest.raises(RuntimeError, match=r"was cast from torch.float32 to torch.bfloat16 by a full-offload optimizer"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)


@pytest.mark.parametrize("kind, where", [
    ("adamw", "between two passes"), ("sign_sgd", "between two passes"),
    ("adamw", "after a short window's last pass"), ("sign_sgd", "after a short window's last pass"),
    ("adamw", "held back until step()"),  # NOTE: SignSGD's step never depends on the factor: never held back
])
def test_an_edit_before_the_step_runs_is_the_weight_the_step_updates(kind, where):
    """An edit between two backward passes of a window, after the last pass of a short window,
    or after the last pass of a window that holds its step back, was lost without a word: the
    step updated the master the window began with and wrote it over the edit. torch's step()
    updates the edited weight, and so must this one."""
    k = 3 if where == "after a short window's last pass" else 2
    model, off, grads = warm_up(kind, k)
    if where == "held back until step()":  # NOTE: the window after one that clipped holds its chunks back
        train_step(model, off, 1, k)
        off.clip_grad_norm_(1e-3)
        off.step()
        off.zero_grad()
        grads.clear()
    backward_pass(model, 2, 0, k)
    values = edit(model) if where == "between two passes" else {}
    before = with_masters(snapshot(off), off, model, values)  # NOTE: taken before any of the window's steps
    backward_pass(model, 2, 1, k)
    if where == "held back until step()":
        assert not any(rec.pieces_done for rec in named(model, off).values())
    if where != "between two passes":
        before = with_masters(before, off, model, edit(model))
    off.step()
    check_stepped_once(model, off, before, grads, 1.0, where)
    check_weights_are_rounded_masters(model, off)
    off.close()


@pytest.mark.filterwarnings("ignore:cpu_offload. zero_grad.. without step")
@pytest.mark.parametrize("call", ["step", "zero_grad"])
@pytest.mark.parametrize("k", [1, 2])
def test_an_edit_after_the_last_backward_stepped_raises_and_is_undone(k, call):
    """The window's last backward already stepped the parameters. An edit after it was
    applied on top of the update at the next backward, where torch's step() would have
    updated the edited weight; with zero_grad() instead of step() (the update stays applied)
    it was taken for the library's own write, and the next step wrote the master over it.
    step() and zero_grad() now finish the step, undo the edit and raise, naming the
    parameters; training goes on from the step's exact result."""
    model, off, grads = warm_up("adamw", k)
    before = snapshot(off)
    train_step(model, off, 1, k)
    edit(model)
    with pytest.raises(RuntimeError, match="changed in place after the window's last backward") as info:
        getattr(off, call)()
    assert names_in(str(info.value), off, model) == set(EDITED) and f"{call}()" in str(info.value)
    check_stepped_once(model, off, before, grads, 1.0, "after the raise")
    check_weights_are_rounded_masters(model, off)
    off.zero_grad()
    grads.clear()
    before = snapshot(off)
    train_step(model, off, 2, k)
    off.step()  # the window closed: the next one trains as usual
    check_stepped_once(model, off, before, grads, 1.0, "the next step")
    off.close()


@pytest.mark.filterwarnings("ignore:cpu_offload. zero_grad.. without step")
def test_an_edit_in_a_held_back_window_then_zero_grad_is_the_weight_the_step_updates():
    """In the window after a clipped step nothing is stepped until the window closes:
    zero_grad() closes it as step() does, so the step updates the edited weights."""
    model, off, grads = warm_up("adamw", 1)
    train_step(model, off, 1, 1)
    off.clip_grad_norm_(1e-3)
    off.step()
    off.zero_grad()
    grads.clear()
    before = snapshot(off)
    train_step(model, off, 2, 1)
    assert not any(rec.pieces_done for rec in named(model, off).values())
    before = with_masters(before, off, model, edit(model))
    off.zero_grad()
    check_stepped_once(model, off, before, grads, 1.0, "held back, zero_grad()")
    check_weights_are_rounded_masters(model, off)
    off.close()


def test_an_edit_after_the_last_backward_of_a_parameter_it_did_not_step_is_kept():
    """A parameter without a gradient in the window is not stepped (as in torch): an edit of
    it before step() is its new weight, with no error."""
    model, off, grads = warm_up("adamw", 1)
    before = snapshot(off)
    train_step(model, off, 1, 1)
    assert "unused" not in grads
    values = edit(model, ("unused",))
    off.step()
    check_stepped_once(model, off, with_masters(before, off, model, values), grads, 1.0, "unused edited")
    check_weights_are_rounded_masters(model, off)
    off.close()


def test_an_edit_and_a_late_learning_rate_raise_after_the_redo():
    """An edit after the last backward of a step that step() redoes (a learning rate set late):
    the redo rewrote the weights from the masters, so the edit was lost silently; it raises
    now, and the state is the redone step's, bit for bit that of the same run without the edit."""
    states = {}
    for edited in (False, True):
        model, off, grads = warm_up("adamw", 1)
        train_step(model, off, 1, 1)
        if edited:
            edit(model)
        for group in off.param_groups:
            group["lr"] *= 0.5
        with pytest.warns(RuntimeWarning, match="changed from"):
            if edited:
                with pytest.raises(RuntimeError, match="changed in place") as info:
                    off.step()
                assert names_in(str(info.value), off, model) == set(EDITED)
            else:
                off.step()
        check_weights_are_rounded_masters(model, off)
        states[edited] = snapshot(off)
        off.close()
    assert_bit_equal(states[True], states[False], "redone")


@pytest.mark.parametrize("max_grad_norm", [None, 1e6])
def test_with_overlap_forward_an_edit_after_wait_for_weights_raises_in_step(max_grad_norm):
    """With overlap_forward the new weights may still be on their way at step(): an edit is
    checked once wait_for_weights() has landed them (docs/full-offload.md), as without it;
    also with norm tracking (max_grad_norm), which reads the window's norms before step()."""
    model, opt = build("adamw")
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, overlap_forward=model, max_grad_norm=max_grad_norm, **SMALL)
    for s in range(3):  # no edit: nothing raises
        train_step(model, off, s, 1)
        off.step()
        off.zero_grad()
    off.wait_for_weights()
    grads.clear()
    before = snapshot(off)
    train_step(model, off, 3, 1)
    off.wait_for_weights()
    edit(model)
    with pytest.raises(RuntimeError, match="changed in place") as info:
        off.step()
    assert names_in(str(info.value), off, model) == set(EDITED)
    off.wait_for_weights()
    check_stepped_once(model, off, before, grads, 1.0, "overlap_forward")
    check_weights_are_rounded_masters(model, off)
    off.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_an_edit_after_a_backward_whose_step_was_skipped_is_kept(overlap):
    """A NaN gradient rolls the window's step back and skips it: the weights are those before
    the step again, and an edit made before step() stays, as torch keeps it."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, overlap_forward=model if overlap else None, **SMALL)
    train_step(model, off, 0, 1)
    off.step()
    off.zero_grad()
    off.wait_for_weights()
    before = snapshot(off)
    with pytest.warns(RuntimeWarning, match="skipped"):
        train_step(model, off, 1, 1, loss_factor=float("nan"))
    values = edit(model)
    off.step()
    assert off.stats()["skipped"]
    after = snapshot(off)
    for n, rec in named(model, off).items():
        master, exp_avg, exp_avg_sq, step = before[rec.name]
        want = values[n].float().reshape(-1) if n in values else master
        assert torch.equal(after[rec.name][0], want) and after[rec.name][3] == step, n
    check_weights_are_rounded_masters(model, off)
    off.close()


@pytest.mark.parametrize("where", ["between two passes", "after the last backward"])
def test_a_ctrl_c_anywhere_in_step_with_an_edit_pending_leaves_the_same_state(sigint_raises, where):
    """SIGINT at each line step() runs, an edit pending: the interrupted step(), then step()
    again as a user would, end in the state of the uninterrupted run; an edit whose step had
    already run is undone, and the error says so (with the Ctrl-C, or from the next step())."""
    def until_step():
        model, off, grads = warm_up("adamw", 2)
        backward_pass(model, 2, 0, 2)
        if where == "between two passes":
            edit(model)
        backward_pass(model, 2, 1, 2)
        if where != "between two passes":
            edit(model)
        return model, off

    def step_and_train(model, off, first=None):
        told = first is not None and "changed in place" in str(first.__context__ or first)
        try:
            off.step()
        except RuntimeError as e:
            assert "changed in place" in str(e) and not told
            told = True
        assert told == (where == "after the last backward")
        off.zero_grad()
        train_step(model, off, 3, 2)
        off.step()
        check_weights_are_rounded_masters(model, off)
        return snapshot(off)

    model, off = until_step()
    want = step_and_train(model, off)
    off.close()
    k = 0
    while True:
        k += 1
        model, off = until_step()
        hit, raised = sigint_at_line(k, off.step)
        if not hit:
            off.close()
            break
        assert isinstance(raised, KeyboardInterrupt), (k, raised)
        assert_bit_equal(step_and_train(model, off, raised), want, f"{where}, line {k}")
        off.close()
    assert k > 20, k


def test_a_model_cast_between_the_last_backward_and_step_is_refused_before_anything_changes():
    """``model.float()`` between the window's last backward and step(): step() raises, naming the
    parameter, and changes nothing; cast back, the same step() finishes as without the cast."""
    states = {}
    for cast in (False, True):
        model, off, grads = warm_up("adamw", 1)
        train_step(model, off, 1, 1)
        if cast:
            before, weights = snapshot(off), [p.detach().clone() for p in model.parameters()]
            model.float()
            with pytest.raises(TypeError, match=r"compute copy of param_groups\[\d\]\[\d\] is now torch.float32"):
                off.step()
            assert_bit_equal(snapshot(off), before, "refused")
            for p, was in zip(model.parameters(), weights):
                p.data = was
        off.step()
        check_weights_are_rounded_masters(model, off)
        states[cast] = snapshot(off)
        off.close()
    assert_bit_equal(states[True], states[False], "cast back")


@pytest.mark.parametrize("when", ["before the window", "before step()"])
def test_a_parameter_made_non_contiguous_after_wrapping_is_refused_before_anything_changes(when):
    """``model.to(memory_format=torch.channels_last)`` after wrapping: a conv weight over two
    staging slots failed in the worker with torch's "view size is not compatible", after the
    other parameters of its chunk had taken a step they did not count. Now the first call that
    sees it raises, naming the parameter and the memory format, and changes nothing; made
    contiguous again, the same window trains as without the change."""
    def build_conv():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3), torch.nn.Flatten(), torch.nn.Linear(32 * 2 * 2, 2))
        off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), **SMALL)
        assert model[0].weight.numel() * 2 > SMALL["pinned_bytes"] // 4  # the conv weight spans two slots
        return model, off

    def window(model, s):
        x = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(s)).bfloat16()
        model(x).float().pow(2).mean().backward()

    states = {}
    for change in (False, True):
        model, off = build_conv()
        window(model, 0)
        off.step()
        off.zero_grad()
        if when == "before step()":
            window(model, 1)
        if change:
            before = snapshot(off)
            model.to(memory_format=torch.channels_last)
            with pytest.raises(ValueError, match=r"compute copy of param_groups\[0\]\[0\] is no longer contiguous.*"
                                                 r"channels_last"):
                if when == "before the window":
                    window(model, 1)
                else:
                    off.step()
            assert_bit_equal(snapshot(off), before, "refused")
            model.to(memory_format=torch.contiguous_format)
        if when == "before the window":
            off.zero_grad()
            window(model, 1)
        off.step()
        check_weights_are_rounded_masters(model, off)
        states[change] = snapshot(off)
        off.close()
    assert_bit_equal(states[True], states[False], "made contiguous again")


@pytest.mark.parametrize("when", ["before the window", "before step()", "before state_dict()"])
def test_parameters_tied_through_data_after_wrapping_are_refused_before_anything_changes(when):
    """``b.data = a.data[:n]`` after wrapping ties two parameters' memory. Construction refuses
    that (each parameter has its own master), but after it the new storage was adopted as an
    ordinary edit: both masters were written back into the one memory, the last write winning,
    and training went on silently wrong. The first call that sees the move now raises as
    construction does, and changes nothing."""
    model, opt = build("adamw")
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    train_step(model, off, 0, 1)
    off.step()
    off.zero_grad()
    count = off.state[model.l2.weight]["step"]
    if when == "before step()":
        train_step(model, off, 1, 1)
    before, own = snapshot(off), model.head.bias.data
    model.head.bias.data = model.l1.bias.data[:8]
    count.fill_(5)  # with a step count edited too: neither is taken
    with pytest.raises(ValueError, match=r"share memory"):
        if when == "before the window":
            train_step(model, off, 1, 1)
        elif when == "before step()":
            off.step()
        else:
            off.state_dict()
    assert_bit_equal(snapshot(off), before, "refused")
    model.head.bias.data = own
    count.fill_(1)
    if when == "before step()":
        off.step()
    off.close()
