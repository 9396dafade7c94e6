# Resuming full offload from a checkpoint: bit-identical to the uninterrupted run after
# clipped steps (the factor the next step speculates with is part of the checkpoint; a
# checkpoint without it still loads), and a plain torch.optim.AdamW checkpoint migrated in
# the usual resume order (wrap, model.load_state_dict, opt.load_state_dict): the loaded
# weights stay, also for parameters the saved run never stepped.
import os
import re
import signal
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_offload
from helpers import SMALL, records_of, sigint_at_line, through_torch_save

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LOSS_SCALES = [0.3, 4.0, 1.0, 12.0, 0.1, 2.5, 0.7, 5.0]  # clips on most steps, by varying factors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(24, 64)
        self.l2 = nn.Linear(64, 8)
        self.late = nn.Linear(8, 8)  # used only from step 3 on

    def forward(self, x, step):
        y = self.l2(F.gelu(self.l1(x)))
        return self.late(y) if step >= 3 else y


def fresh(seed=0, **opts):
    torch.manual_seed(seed)
    model = Net()
    opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), **HP), offload="full", **SMALL, **opts)
    return model, opt


def train(model, opt, steps, *, clip_call=False):
    for s in steps:
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        (model(x.to(torch.bfloat16), s).float().pow(2).mean() * LOSS_SCALES[s]).backward()
        if clip_call:
            opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()



@pytest.mark.parametrize("accum, passes", [(1, 1), (2, 2), (2, 1)], ids=["window", "accumulated", "short window"])
def test_a_checkpoint_a_signal_handler_saves_during_step_is_the_state_before_or_after_it(accum, passes):
    """A handler of SIGTERM or SIGUSR1 (a cluster's notice of preemption) that saves
    ``opt.state_dict()``: landing in step() as it showed the new step counts, it saved a
    parameter whose step was the new one and whose master's the old, and the resume then
    dropped that master for the bf16 weight, blaming another optimizer. It now runs once the
    step's change of the host state is whole."""
    seed = int(torch.randint(1 << 30, ()))
    k, outcomes = 0, set()
    while True:
        k += 1
        model, opt = fresh(seed=seed, grad_accum_steps=accum)
        train(model, opt, range(2))
        before = through_torch_save(opt.state_dict())
        for _ in range(passes):
            x = torch.randn(16, 24, generator=torch.Generator().manual_seed(2))
            model(x.to(torch.bfloat16), 2).float().pow(2).mean().backward()
        saved = []

        def on_signal(signum, frame, opt=opt, saved=saved):
            try:
                saved.append(through_torch_save(opt.state_dict()))
            except RuntimeError as refused:  # between the window's last backward and step()
                assert "step()" in str(refused)
                outcomes.add("refused")
        previous = signal.signal(signal.SIGUSR1, on_signal)
        try:
            hit, raised = sigint_at_line(k, opt.step, signum=signal.SIGUSR1)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        if not hit:
            break
        assert raised is None, (k, raised)
        after = through_torch_save(opt.state_dict())
        opt.close()
        for checkpoint in saved:
            entries = checkpoint["state"].values()
            assert all(int(e["step"]) == int(e["master_step"]) for e in entries), k
            which = [name for name, want in (("before", before), ("after", after))
                     if all(torch.equal(e[key], want["state"][i][key])
                            for i, e in checkpoint["state"].items() for key in ("master", "exp_avg", "exp_avg_sq", "step"))]
            assert which, k
            outcomes.update(which)
    assert k > 20 and "after" in outcomes, (k, outcomes)


def host_state(opt):
    return [(r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), r.step) for r in records_of(opt)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
def test_resume_after_clipped_steps_is_bit_identical(state_dtype, how):
    opts = dict(state_dtype=state_dtype, **({"max_grad_norm": 0.05} if how == "max_grad_norm" else {}))
    clip_call = how == "clip_grad_norm_"
    model, opt = fresh(**opts)
    train(model, opt, range(8), clip_call=clip_call)
    straight = host_state(opt)
    assert opt.stats()["clip_coef"] < 1

    model, opt = fresh(**opts)
    train(model, opt, range(4), clip_call=clip_call)
    ck = through_torch_save({"model": model.state_dict(), "optim": opt.state_dict()})
    model, opt = fresh(seed=1, **opts)  # another process: other initial weights
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    train(model, opt, range(4, 8), clip_call=clip_call)
    for i, (a, b) in enumerate(zip(host_state(opt), straight)):
        assert a[3] == b[3], i
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x, y), i


def test_checkpoint_without_the_speculation_factor_still_loads():
    model, opt = fresh(max_grad_norm=0.05)
    train(model, opt, range(4))
    sd = through_torch_save(opt.state_dict())
    for group in sd["param_groups"]:
        group.pop("speculation_factor")
    model2, opt2 = fresh(max_grad_norm=0.05)
    opt2.load_state_dict(sd)
    assert all("speculation_factor" not in g for g in opt2.param_groups)  # never leaks into the groups
    train(model2, opt2, range(4, 6))
    train(model, opt, range(4, 6))
    for a, b in zip(host_state(opt2), host_state(opt)):  # the first redo starts from factor 1: float32 rounding
        assert a[3] == b[3]
        assert float((a[0] - b[0]).norm() / b[0].norm()) < 1e-6


@pytest.mark.filterwarnings("ignore:cpu_offload. the masters of")  # the template's, asserted below
@pytest.mark.parametrize("how", ["directly", "after a state_dict() read", "into a state_dict() template"])
def test_plain_adamw_checkpoint_migrates_in_the_usual_resume_order(how):
    """The bf16 weights loaded after wrapping give the masters, which lack the checkpoint's fp32
    low bits: a warning says so. A state_dict() read in between (logging, or the template of a
    torch.distributed.checkpoint load, which leaves the template's masters where the checkpoint
    has none) took those weights as the masters already, and the warning was lost."""
    torch.manual_seed(5)
    source = Net()
    sopt = torch.optim.AdamW(source.parameters(), **HP)
    for s in range(2):  # `late` gets no gradient: the checkpoint has no state for it
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        source(x, s).pow(2).mean().backward()
        sopt.step()
        sopt.zero_grad()
    ck = through_torch_save({"model": source.state_dict(), "optim": sopt.state_dict()})
    assert len(ck["optim"]["state"]) == 4

    model, opt = fresh(seed=1)
    model.load_state_dict(ck["model"])
    optim = ck["optim"]
    if how != "directly":
        template = opt.state_dict()
    if how == "into a state_dict() template":  # what a partial load leaves: the checkpoint's keys, the template's others
        for index, entry in optim["state"].items():
            template["state"][index].update(entry)
        for group, saved in zip(template["param_groups"], optim["param_groups"]):
            group.update(saved)
        optim = template
    names = r"\['param_groups\[0\]\[0\]', 'param_groups\[0\]\[1\]', 'param_groups\[0\]\[2\]', 'param_groups\[0\]\[3\]'\]"
    with pytest.warns(RuntimeWarning, match=f"the state of {names} has no fp32 master .* load the fp32 weights into "
                                            "the model before wrapping") as caught:
        opt.load_state_dict(optim)
    if how == "into a state_dict() template":
        assert any("or the checkpoint has no masters" in str(w.message) for w in caught)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ck["model"][name].to(value.dtype)), name

    ref = Net()
    ref.load_state_dict(ck["model"])
    ropt = torch.optim.AdamW(ref.parameters(), **HP)
    ropt.load_state_dict(ck["optim"])
    for s in range(2, 9):
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        model(x.to(torch.bfloat16), s).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x, s).pow(2).mean().backward()
        ropt.step()
        ropt.zero_grad()
    for rec, (name, p) in zip(records_of(opt), ref.named_parameters()):
        # the masters start from the bf16 weights the model holds: bf16 rounding apart
        assert float((rec.master.view(rec.shape) - p.detach()).norm() / p.detach().norm()) < 1e-2, name


def test_a_plain_adamw_checkpoint_loaded_before_wrapping_keeps_fp32_masters_without_a_warning():
    """The remedy the warning above names: the fp32 weights loaded first, then wrapped, then
    the optimizer's state: the masters are the checkpoint's fp32 weights, bit for bit."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    source = Net()
    sopt = torch.optim.AdamW(source.parameters(), **HP)
    for s in range(4):
        x = torch.randn(16, 24)
        source(x, s).pow(2).mean().backward()
        sopt.step()
        sopt.zero_grad()
    ck = through_torch_save({"model": source.state_dict(), "optim": sopt.state_dict()})
    model = Net()
    model.load_state_dict(ck["model"])
    opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), **HP), offload="full", **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(ck["optim"])
    for rec, (name, p) in zip(records_of(opt), source.named_parameters()):
        assert torch.equal(rec.master, p.detach().reshape(-1)), name
    opt.close()


def _carry_through_the_plain_optimizer(make_optimizer, full_steps, plain_steps):
    """Train under full offload for ``full_steps``, save, resume with the plain optimizer
    (``make_optimizer(params)``) on the saved masters for ``plain_steps``, and load its
    checkpoint into full offload again. Returns (the full-offload save, the plain one, the
    weights at the plain save, the new full-offload optimizer, the warnings of its load)."""
    torch.manual_seed(int(torch.randint(1 << 30, ())))
    model = Net()
    opt = cpu_offload.offload_optimizer(make_optimizer(model.parameters()), offload="full", **SMALL)
    train(model, opt, range(full_steps))
    saved = through_torch_save(opt.state_dict())
    opt.close()
    model.float()
    with torch.no_grad():
        for p, entry in zip(model.parameters(), saved["state"].values()):
            p.copy_(entry["master"].view(p.shape))
    plain = make_optimizer(model.parameters())
    plain.load_state_dict(saved)
    for s in range(full_steps, full_steps + plain_steps):
        x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
        model(x, s).pow(2).mean().backward()
        plain.step()
        plain.zero_grad()
    carried = through_torch_save(plain.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    full = cpu_offload.offload_optimizer(make_optimizer(model.parameters()), offload="full", **SMALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full.load_state_dict(carried)
    return saved, carried, weights, full, caught


def test_masters_carried_through_an_optimizer_that_does_not_step_them_are_not_loaded():
    """A full-offload checkpoint resumed by a plain torch AdamW (HF Trainer resuming it without
    offload): torch keeps the unknown "master" entries and saves them again, untouched, with
    the steps it took. Loaded back into full offload, those stale masters replaced the weights:
    every step of the plain phase undone, without a word. A master whose step count is not
    the entry's is now left out, with a warning, and the weights give the masters."""
    _, carried, weights, full, caught = _carry_through_the_plain_optimizer(
        lambda params: torch.optim.AdamW(params, **HP), full_steps=3, plain_steps=3)
    assert all("master" in e for e in carried["state"].values())  # kept by torch, as saved at step 3
    for rec, w in zip(records_of(full), weights):
        assert rec.step == int(carried["state"][rec.index]["step"])
        assert torch.equal(rec.master, w.reshape(-1)), rec.name  # the weights at the save, fp32
    assert any(re.search(r"masters of \[.*\] were saved at step 3, .* step count is 6", str(w.message)) for w in caught)
    full.close()


def test_signsgd_masters_carried_through_a_plain_signsgd_are_not_loaded():
    """The same through a plain cpu_offload.SignSGD, which kept the entries' "step" as loaded:
    "master_step" still matched it, so the masters of the first save replaced the weights and
    the plain phase's steps were undone, silently. SignSGD now advances a step count it holds."""
    saved, carried, weights, full, caught = _carry_through_the_plain_optimizer(
        lambda params: cpu_offload.SignSGD(params, lr=1e-2, weight_decay=0.1), full_steps=2, plain_steps=3)
    for rec, w in zip(records_of(full), weights):
        assert torch.equal(rec.master, w.reshape(-1)), rec.name
    steps = [(int(saved["state"][rec.index]["step"]), int(carried["state"][rec.index]["step"]), rec.step)
             for rec in records_of(full)]
    assert all(carried_step == loaded for _, carried_step, loaded in steps)
    assert any(carried_step > saved_step for saved_step, carried_step, _ in steps)  # the plain phase counted
    assert any(re.search(r"masters of \[.*\] were saved at step 2, .* step count is 5", str(w.message)) for w in caught)
    full.close()


def test_a_partial_load_that_leaves_the_masters_keeps_the_weights_loaded_before():
    """torch.distributed.checkpoint with allow_partial_load fills a state_dict() template in
    place: from a plain AdamW checkpoint the steps and moments load, the masters stay the
    template's own live views. Loaded after the model's weights (set_model_state_dict), those
    unchanged masters overwrote the weights just loaded. The template's master step count
    (that of the fresh optimizer) now tells them apart: the weights give the masters."""
    model, opt = fresh()
    template = opt.state_dict()
    ck_model = {k: v.float() * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(ck_model)  # as set_model_state_dict does
    # as DCP's in-place load of a plain checkpoint leaves it: steps and moments loaded, masters not
    template["state"] = {i: {**e, "step": torch.tensor(4.0), "exp_avg": torch.ones_like(e["exp_avg"]),
                             "exp_avg_sq": torch.ones_like(e["exp_avg_sq"])} for i, e in template["state"].items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(template)
    for rec, name in zip(records_of(opt), dict(model.named_parameters())):
        assert rec.step == 4 and torch.equal(rec.master, ck_model[name].to(torch.bfloat16).float().reshape(-1)), name
    assert any("were saved at step 0" in str(w.message) for w in caught)
    opt.close()


def test_the_state_of_a_parameter_frozen_at_wrap_time_is_saved_again():
    """torch keeps a frozen parameter's state. A checkpoint loaded into full offload while a
    parameter was frozen lost that parameter's entry in the next save (and a stepped optimizer
    wrapped so lost it too): unfrozen later under a plain AdamW, it started again from step 0.
    Its entry is now kept as loaded and saved again."""
    def stepped():
        torch.manual_seed(0)
        model = Net()
        plain = torch.optim.AdamW(model.parameters(), **HP)
        for s in range(4):
            x = torch.randn(16, 24, generator=torch.Generator().manual_seed(s))
            model(x, s).pow(2).mean().backward()
            plain.step()
            plain.zero_grad()
        model.l1.weight.requires_grad_(False)
        return model, plain

    for how in ("load_state_dict", "wrap a stepped optimizer"):
        model, plain = stepped()
        saved = through_torch_save(plain.state_dict())
        if how == "load_state_dict":
            full = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), **HP), offload="full", **SMALL)
            full.load_state_dict(saved)
        else:
            full = cpu_offload.offload_optimizer(plain, offload="full", **SMALL)
        again = through_torch_save(full.state_dict())
        full.close()
        assert set(again["state"]) == set(saved["state"]), how
        for key, value in saved["state"][0].items():  # l1.weight, frozen
            assert torch.equal(again["state"][0][key], value), (how, key)
