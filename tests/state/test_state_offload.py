# StateOffloadOptimizer (offload="optimizer") on CPU parameters: the state moves
# between separate host buffers and working tensors around each step, exactly
# as it does between pinned host RAM and the GPU.
import copy
import io
import time
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

from cpu_offload.optim import SignSGD
from cpu_offload._state.copies import SyncStateCopies
from cpu_offload._state.optimizer import StateOffloadOptimizer
from cpu_offload._state.staging import _HOST_BUFFERS
from helpers import state_staging_of


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    data = [torch.randn(8, 12, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    return model, data


def train(model, opt, data, clip=None):
    for x in data:
        model(x).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # grads stay on the device
        opt.step()
        opt.zero_grad()


def test_equals_wrapped_optimizer_bitwise():
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1))
    train(m1, plain, data, clip=0.5)
    train(m2, wrapped, data, clip=0.5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    # between steps the moments are the host buffers, not the working copies
    for p in m2.parameters():
        assert wrapped.state[p]["exp_avg"] is state_staging_of(wrapped).host[(id(p), "exp_avg")]
    assert wrapped.param_groups is wrapped.optimizer.param_groups


def test_close_gives_the_optimizer_back_with_its_state_on_the_host():
    """A StateOffloadOptimizer had no close(): the only way to hand its torch optimizer or its
    parameters to another wrapper was to drop every reference to it. close() waits for the
    last copies, removes its gradient hooks and gives the optimizer back; a new wrapper over
    it trains on from the state it left, bit for bit as the plain optimizer."""
    m1, data = model_and_data(seed=int(torch.randint(1 << 30, ())))
    m2 = copy.deepcopy(m1)
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    inner = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = StateOffloadOptimizer(inner)
    train(m1, plain, data[:3])
    train(m2, wrapped, data[:3])
    hooks = [len(p._post_accumulate_grad_hooks or {}) for p in m2.parameters()]
    wrapped.close()
    wrapped.close()  # idempotent
    assert [len(p._post_accumulate_grad_hooks or {}) for p in m2.parameters()] == [h - 1 for h in hooks]
    for p in m2.parameters():
        assert inner.state[p]["exp_avg"] is state_staging_of(wrapped).host[(id(p), "exp_avg")]
    for call in (wrapped.step, lambda: wrapped.load_state_dict(inner.state_dict())):
        with pytest.raises(RuntimeError, match=r"StateOffloadOptimizer was closed.*wrap"):
            call()
    assert wrapped.state_dict()["state"][0]["step"] == 3  # still readable
    again = StateOffloadOptimizer(inner)
    train(m1, plain, data[3:])
    train(m2, again, data[3:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_parameter_listed_twice_in_a_group_trains_as_torch_steps_it():
    """torch steps a parameter listed twice in a group (with a warning) once, with one state.
    The check for state tensors sharing storage found that one state under both positions:
    the first step was taken, then refused, and every step after it."""
    m1, data = model_and_data(seed=int(torch.randint(1 << 30, ())))
    m2 = copy.deepcopy(m1)
    runs = []
    for model, wrap in ((m1, False), (m2, True)):
        first, second = model[0].weight, model[2].weight
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
            opt = torch.optim.AdamW([first, model[0].bias, first, second], lr=1e-2, weight_decay=0.1)
        opt = StateOffloadOptimizer(opt) if wrap else opt
        train(model, opt, data)
        runs.append((model, opt))
    (m1, plain), (m2, wrapped) = runs
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert wrapped.stats()["d2h_bytes"] == sum(8 * p.numel() for p in (m2[0].weight, m2[0].bias, m2[2].weight))
    wrapped.close()  # one gradient hook each, all removed
    assert all(not p._post_accumulate_grad_hooks for p in m2.parameters())


def test_a_parameter_out_of_the_groups_keeps_its_state_where_it_is_also_with_a_gradient():
    """torch leaves the state of a parameter taken out of param_groups alone, and steps it
    again once it is put back. Its gradient hook still fired, and its state was copied in and
    out with the others for a step that did not use it."""
    m1, data = model_and_data(seed=int(torch.randint(1 << 30, ())))
    m2 = copy.deepcopy(m1)
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2))
    train(m1, plain, data[:2])
    train(m2, wrapped, data[:2])
    out = m2[0].weight
    kept = wrapped.state[out]["exp_avg"]
    before = kept.clone()
    for model, opt in ((m1, plain), (m2, wrapped)):
        first = opt.param_groups[0]["params"].pop(0)
        train(model, opt, data[2:3])  # its gradient arrives; nothing steps it
        opt.param_groups[0]["params"].insert(0, first)
    assert wrapped.state[out]["exp_avg"] is kept and torch.equal(kept, before)
    in_groups = sum(8 * p.numel() for p in m2.parameters() if p is not out)
    assert wrapped.stats()["h2d_bytes"] == wrapped.stats()["d2h_bytes"] == in_groups
    train(m1, plain, data[3:])
    train(m2, wrapped, data[3:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_host_state_an_optimizer_keeps_itself_stays_on_the_host():
    """A step copies in the host buffers a wrapper's copy-out made (left by a closed or dropped
    wrapper, or kept by torch for a parameter out of the groups), not a host tensor an optimizer
    keeps on the host on purpose for a parameter elsewhere (a histogram, a counter). The meta
    device stands for a GPU here."""
    m, data = model_and_data()
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2))
    train(m, wrapped, data[:1])
    assert all(_HOST_BUFFERS.get(id(t)) is t for t in state_staging_of(wrapped).host.values())
    p = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    inner = torch.optim.SGD([p], lr=0.1)
    staging = state_staging_of(StateOffloadOptimizer(inner))
    made = torch.empty(4, 4)
    _HOST_BUFFERS[id(made)] = made  # as a copy-out records the buffers it makes
    inner.state[p] = {"hist": torch.zeros(16), "momentum_buffer": made, "count": torch.tensor(3.0)}
    assert [key for key, *_ in staging._entries(p)] == ["momentum_buffer"]


def test_state_under_a_key_that_is_not_a_parameter_stays_as_the_optimizer_keeps_it():
    """torch's state may hold entries under keys other than parameters (its state_dict keeps
    them): an optimizer counting its steps in ``self.state["global_step"]`` failed from the
    second step on with "'int' object has no attribute 'values'"."""
    class Counting(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            self.state["global_step"] = self.state.get("global_step", 0) + 1
            self.state["scale"] = self.state.get("scale", torch.ones(())) * 0.9
            return super().step(closure)

    m1, data = model_and_data(seed=int(torch.randint(1 << 30, ())))
    m2 = copy.deepcopy(m1)
    plain = Counting(m1.parameters(), lr=0.1, momentum=0.9)
    wrapped = StateOffloadOptimizer(Counting(m2.parameters(), lr=0.1, momentum=0.9))
    train(m1, plain, data)
    train(m2, wrapped, data)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    want, got = plain.state_dict()["state"], wrapped.state_dict()["state"]
    assert got["global_step"] == want["global_step"] == len(data)
    assert torch.equal(got["scale"], want["scale"])
    for key in range(4):
        assert torch.equal(got[key]["momentum_buffer"], want[key]["momentum_buffer"])


def test_a_parameter_that_is_not_a_leaf_is_refused_by_name_and_add_param_group_adds_nothing():
    """torch's optimizers take non-leaf parameters with differentiable=True. The wrapper failed on
    them with torch's "post accumulate grad hooks cannot be registered on non-leaf tensors", and
    add_param_group had added the group first: every later step raised the same."""
    leaf = nn.Parameter(torch.randn(3))
    computed = torch.randn(3, requires_grad=True) * 2
    with pytest.raises(ValueError, match=r"param_groups\[0\]\[1\] is not a leaf tensor.*offload=\"none\""):
        StateOffloadOptimizer(torch.optim.SGD([leaf, computed], lr=0.1, differentiable=True))
    inner = torch.optim.SGD([leaf], lr=0.1, differentiable=True)
    wrapped = StateOffloadOptimizer(inner)  # the failed construction above did not keep it
    with pytest.raises(ValueError, match=r"param_groups\[1\]\[0\] is not a leaf tensor"):
        wrapped.add_param_group({"params": [computed]})
    assert len(wrapped.param_groups) == len(inner.param_groups) == 1
    leaf.grad = torch.ones(3)
    for opt in (torch.optim.SGD([leaf], lr=0.1, differentiable=True), wrapped):  # the next step is torch's
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
            opt.step()


def test_replacing_the_state_resets_it_as_in_torch():
    """``opt.state = defaultdict(dict)`` (a reset, as torch allows) raised an AttributeError
    (a property without a setter). It replaces the wrapped optimizer's state: the next steps
    start from fresh moments, bit for bit as the plain optimizer's."""
    from collections import defaultdict

    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1))
    for model, opt in ((m1, plain), (m2, wrapped)):
        train(model, opt, data[:3])
        opt.state = defaultdict(dict)
        assert len(opt.state) == 0
        train(model, opt, data[3:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert int(wrapped.state[p2]["step"]) == int(plain.state[p1]["step"]) == 3
        assert torch.equal(wrapped.state[p2]["exp_avg_sq"], plain.state[p1]["exp_avg_sq"])


def closure_steps(model, opt, data):
    losses = []
    for x in data:
        def closure(x=x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss
        losses.append(opt.step(closure))
    return losses


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=4, history_size=3),  # calls its closure several times
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
], ids=["LBFGS", "AdamW"])
def test_step_with_a_closure_equals_the_wrapped_optimizer_bitwise(make):
    """The closure goes to the wrapped optimizer's step: LBFGS, which needs it there, used to
    raise a TypeError; the losses the steps return are the wrapped optimizer's."""
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain, wrapped = make(m1.parameters()), StateOffloadOptimizer(make(m2.parameters()))
    want, got = closure_steps(m1, plain, data), closure_steps(m2, wrapped, data)
    assert [float(loss) for loss in got] == [float(loss) for loss in want]
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert wrapped.stats()["prefetched_bytes"] == 0  # the closure's backward found the state in
    if not isinstance(plain, torch.optim.LBFGS):  # steps without a closure go on as before
        train(m2, wrapped, data[:2])
        train(m1, plain, data[:2])
        assert wrapped.stats()["prefetched_bytes"] > 0
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["positional", "keyword", "none", "keyword None"])
def test_the_wrapped_optimizers_step_hooks_see_the_closure_as_it_was_passed(how):
    """The closure of ``opt.step(closure=c)`` reached the wrapped optimizer's step, and its
    step pre-hooks, as a positional argument: a hook that wraps ``kwargs["closure"]`` (here,
    halving the gradients it makes) was skipped, silently, and training differed from torch."""
    def run(wrap):
        m, data = model_and_data()
        inner = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        seen = []

        def pre_hook(opt, args, kwargs):
            seen.append((len(args), sorted(kwargs), kwargs.get("closure", 0) is None))
            if kwargs.get("closure") is not None:
                user = kwargs["closure"]

                def halved():
                    loss = user()
                    for p in m.parameters():
                        p.grad.mul_(0.5)
                    return loss
                return args, {**kwargs, "closure": halved}
        inner.register_step_pre_hook(pre_hook)
        opt = StateOffloadOptimizer(inner) if wrap else inner
        for x in data[:3]:
            def closure(x=x):
                opt.zero_grad()
                loss = m(x).pow(2).mean()
                loss.backward()
                return loss
            if how == "positional":
                opt.step(closure)
            elif how == "keyword":
                opt.step(closure=closure)
            else:
                closure()
                opt.step() if how == "none" else opt.step(closure=None)
        return [p.detach().clone() for p in m.parameters()], seen

    (want, want_seen), (got, got_seen) = run(False), run(True)
    assert got_seen == want_seen
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_state_dict_round_trip_and_scheduler():
    m1, data = model_and_data()
    opt = StateOffloadOptimizer(SignSGD(m1.parameters(), lr=1e-2, weight_decay=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    train(m1, opt, data[:3])
    sched.step()
    assert abs(opt.param_groups[0]["lr"] - 9e-3) < 1e-12

    m2, _ = model_and_data()
    m3, _ = model_and_data()
    a = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2))
    train(m2, a, data[:3])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    m3.load_state_dict(m2.state_dict())
    b = StateOffloadOptimizer(torch.optim.AdamW(m3.parameters(), lr=1e-2))
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    for p in m3.parameters():
        assert b.state[p]["exp_avg"] is state_staging_of(b).host[(id(p), "exp_avg")]
    train(m2, a, data[3:])
    train(m3, b, data[3:])
    for x, y in zip(m2.parameters(), m3.parameters()):
        assert torch.equal(x, y)


def test_add_param_group_passes_through():
    model, data = model_and_data()
    opt = StateOffloadOptimizer(torch.optim.AdamW(model[0].parameters(), lr=1e-2))
    opt.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    train(model, opt, data[:2])
    assert len(opt.state) == 4


def test_param_groups_stay_shared_through_load_state_dict_round_trips():
    """accelerate's prepare() and every resume run load_state_dict(state_dict()):
    the scheduler, the wrapper and the wrapped optimizer keep editing and reading
    one list of the same dicts, so the run stays bit-identical to plain AdamW."""
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1))
    groups, dicts = wrapped.param_groups, list(wrapped.param_groups)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (plain, wrapped)]
    for round_trip in range(4):
        train(m1, plain, data[:2])
        train(m2, wrapped, data[:2])
        for opt, sched in zip((plain, wrapped), scheds):
            if round_trip % 2:  # through bytes, as a resume does
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt.load_state_dict(torch.load(buf))
            else:  # accelerate's AcceleratedOptimizer.__init__
                opt.load_state_dict(opt.state_dict())
            sched.step()
        assert wrapped.param_groups is groups and wrapped.optimizer.param_groups is groups
        assert all(a is b for a, b in zip(groups, dicts))
        assert wrapped.optimizer.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 1e-2 * 0.5 ** (round_trip + 1)
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(a, b), f"diverged before round trip {round_trip}"
    train(m1, plain, data[2:])
    train(m2, wrapped, data[2:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b), "diverged after the last round trip"
    assert set(plain.param_groups[0]) == set(groups[0])  # initial_lr and AdamW's defaults kept


def test_load_state_dict_replaces_group_options_like_torch():
    model, data = model_and_data()
    opt = StateOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(model, opt, data[:1])
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 3e-3
    sd["param_groups"][0]["custom"] = 1
    opt.load_state_dict(sd)
    assert opt.optimizer.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["custom"] == 1
    assert opt.param_groups[0]["params"] == list(model.parameters())


def _hook_log(opt):
    """Register one hook of every state-dict kind (with prepend and return values)
    on ``opt``, run state_dict/load_state_dict, and return what was seen."""
    log = []
    me = lambda o: "opt" if o is opt else repr(o)  # noqa: E731
    opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre_a", me(o))))
    opt.register_state_dict_pre_hook(lambda o: log.append(("sd_pre_b", me(o))), prepend=True)

    def post_edit(o, sd):
        log.append(("sd_post_edit", me(o), sorted(sd)))
        sd["edited"] = 1  # in place, returns None

    def post_replace(o, sd):
        log.append(("sd_post_replace", me(o), sorted(sd)))
        return {**sd, "replaced": 2}

    opt.register_state_dict_post_hook(post_edit)
    opt.register_state_dict_post_hook(post_replace)
    opt.register_state_dict_post_hook(lambda o, sd: log.append(("sd_post_last", me(o), sorted(sd))))
    sd = opt.state_dict()
    log.append(("state_dict returned", sorted(sd)))

    passed = {"state": sd["state"], "param_groups": sd["param_groups"]}

    def load_pre_edit(o, sd_in):
        log.append(("load_pre_edit", me(o), sd_in is passed, sorted(sd_in)))
        sd_in["seen"] = True  # on the shallow copy: the caller's dict is untouched

    def load_pre_replace(o, sd_in):
        log.append(("load_pre_replace", me(o), sorted(sd_in)))
        groups = [dict(g, lr=0.125) for g in sd_in["param_groups"]]
        return {"state": sd_in["state"], "param_groups": groups}

    opt.register_load_state_dict_pre_hook(load_pre_replace)
    opt.register_load_state_dict_pre_hook(load_pre_edit, prepend=True)
    opt.register_load_state_dict_pre_hook(lambda o, sd_in: log.append(("load_pre_last", sorted(sd_in))))
    opt.register_load_state_dict_post_hook(lambda o: log.append(("load_post_a", me(o), o.param_groups[0]["lr"])))
    handle = opt.register_load_state_dict_post_hook(lambda o: log.append(("removed",)))
    opt.register_load_state_dict_post_hook(lambda o: log.append(("load_post_b", me(o))), prepend=True)
    handle.remove()
    opt.load_state_dict(passed)
    log.append(("caller's dict", sorted(passed)))
    return log


def test_state_dict_hooks_run_as_torch_runs_them():
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2))
    train(m1, plain, data[:1])
    train(m2, wrapped, data[:1])
    expected = _hook_log(plain)
    assert [entry[0] for entry in expected] == [
        "sd_pre_b", "sd_pre_a", "sd_post_edit", "sd_post_replace", "sd_post_last", "state_dict returned",
        "load_pre_edit", "load_pre_replace", "load_pre_last", "load_post_b", "load_post_a", "caller's dict"]
    assert _hook_log(wrapped) == expected
    assert wrapped.optimizer.param_groups[0]["lr"] == 0.125  # the pre hook's replacement was loaded
    # hooks registered on the wrapped optimizer still run, once, inside the wrapper's calls
    calls = []
    wrapped.optimizer.register_state_dict_pre_hook(lambda o: calls.append(o))
    wrapped.state_dict()
    assert calls == [wrapped.optimizer]


class _Copies(SyncStateCopies):
    """Stands in for the CUDA copy engine: logs the waits a reader must make."""

    def __init__(self, log):
        super().__init__(torch.device("cpu"))
        self.log = log

    def wait_copy_outs(self):
        self.log.append("copy-outs waited")

    def synchronize(self):
        self.log.append("all copies waited")


def test_state_and_state_dict_wait_for_copies_to_the_host():
    model, data = model_and_data()
    opt = StateOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(model, opt, data[:1])
    log = []
    state_staging_of(opt).copies = {"cuda:0": _Copies(log)}  # the non-blocking D2H copies of the last step
    assert len(opt.state) == 4
    assert log == ["copy-outs waited"]
    opt.state_dict()
    assert log == ["copy-outs waited"] * 2
    state_staging_of(opt).copies = {"cuda:0": _Copies(log)}
    opt.load_state_dict(opt.optimizer.state_dict())
    assert log[2] == "all copies waited"  # before anything writes the host buffers


def _calls_under_global_step_hooks(prepare):
    """Train plainly and wrapped, from one random seed, under a global step pre-hook that halves
    every gradient and a post-hook; assert both give the same weights and return each run's
    hook calls. ``prepare(opt, calls)`` edits the torch optimizer before it is wrapped."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def run(wrap):
        calls = []

        def pre(opt, args, kwargs):
            calls.append(("pre", type(opt).__name__))
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad.mul_(0.5)

        handles = [register_optimizer_step_pre_hook(pre),
                   register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", type(o).__name__)))]
        try:
            model, data = model_and_data(seed=int(torch.randint(1 << 30, ())))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            prepare(opt, calls)
            if wrap:
                opt = StateOffloadOptimizer(opt)
            train(model, opt, data[:3])
        finally:
            for handle in handles:
                handle.remove()
        return [p.detach().clone() for p in model.parameters()], calls

    seed = int(torch.randint(1 << 30, ()))
    torch.manual_seed(seed)
    plain, plain_calls = run(False)
    torch.manual_seed(seed)
    wrapped, wrapped_calls = run(True)
    for a, b in zip(plain, wrapped):
        assert torch.equal(a, b)
    return plain_calls, wrapped_calls


def test_global_step_hooks_run_once_a_step_around_the_wrapper():
    """torch runs each global step hook once per step(); they ran around the wrapper's step and
    again around the wrapped optimizer's, so a hook that scales the gradients scaled them twice.
    The wrapped optimizer's own step hooks still run, once, inside."""
    def own_hook(opt, calls):
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("own pre", type(o).__name__)))

    plain_calls, wrapped_calls = _calls_under_global_step_hooks(own_hook)
    assert plain_calls == [("pre", "AdamW"), ("own pre", "AdamW"), ("post", "AdamW")] * 3
    assert wrapped_calls == [("pre", "StateOffloadOptimizer"), ("own pre", "AdamW"),
                             ("post", "StateOffloadOptimizer")] * 3


def test_global_step_hooks_run_once_a_step_around_a_step_patched_on_the_wrapped_optimizer():
    """A step patched on the wrapped optimizer's instance (``opt.step = counted(opt.step)``)
    was called as it was, and the hooked step it calls ran the global step hooks a second
    time inside the wrapper's step."""
    def patch_step(opt, calls):
        hooked = opt.step

        def counted(*args, **kwargs):
            calls.append(("patched", type(hooked.__self__).__name__))
            return hooked(*args, **kwargs)
        opt.step = counted

    plain_calls, wrapped_calls = _calls_under_global_step_hooks(patch_step)
    assert plain_calls == [("patched", "AdamW"), ("pre", "AdamW"), ("post", "AdamW")] * 3
    assert wrapped_calls == [("pre", "StateOffloadOptimizer"), ("patched", "AdamW"),
                             ("post", "StateOffloadOptimizer")] * 3


def test_a_global_step_hook_removed_while_a_patched_step_wraps_it_stays_removed(monkeypatch):
    """For a step patched on the wrapped optimizer, the global hooks were replaced by filters and
    written back after it: a hook whose handle another thread removed in between came back, for
    good, and ran at every later step of every optimizer."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

    from cpu_offload._common import wrapping

    calls = []

    def hook(opt, args, kwargs):
        calls.append(type(opt).__name__)
    handle = register_optimizer_step_pre_hook(hook)

    class RemovedMeanwhile(wrapping._SkipFiltered):
        def __init__(self, wrapped):
            super().__init__(wrapped)
            if wrapped is hook:
                handle.remove()  # as another thread may, between a read of the table and a write to it
    monkeypatch.setattr(wrapping, "_SkipFiltered", RemovedMeanwhile)
    model, data = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooked = opt.step
    opt.step = lambda *args, **kwargs: hooked(*args, **kwargs)
    wrapped = StateOffloadOptimizer(opt)
    train(model, wrapped, data[:2])
    monkeypatch.undo()
    calls.clear()
    train(model, wrapped, data[2:4])
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), data[4:])
    assert calls == []
    assert all(getattr(h, "hook", h) is not hook for h in _global_optimizer_pre_hooks.values())


def test_param_groups_assigned_to_the_wrapper_are_the_ones_the_step_reads():
    """A new param_groups list (new dicts, another lr) assigned to the wrapper (as accelerate's
    AcceleratedOptimizer.param_groups setter does) reached the wrapper only: the wrapped
    optimizer stepped with the old lr."""
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2))
    train(m1, plain, data[:2])
    train(m2, wrapped, data[:2])
    plain.param_groups = [dict(g, lr=3e-2) for g in plain.param_groups]
    wrapped.param_groups = [dict(g, lr=3e-2) for g in wrapped.param_groups]
    train(m1, plain, data[2:])
    train(m2, wrapped, data[2:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert wrapped.optimizer.param_groups[0]["lr"] == wrapped.state_dict()["param_groups"][0]["lr"] == 3e-2


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_grad_scaler_hands_its_scale_to_a_fused_wrapped_step(kind):
    """GradScaler gives its scale to optimizers that unscale in their fused step; the wrapper
    hid that they do, so GradScaler unscaled the gradients itself, which rounds otherwise (a
    scale that is not a power of two)."""
    runs = []
    for wrap in (False, True):
        model, data = model_and_data()
        if kind == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
        opt = StateOffloadOptimizer(opt) if wrap else opt
        scaler = torch.amp.GradScaler("cpu", init_scale=3.0e3, growth_interval=2)
        for i, x in enumerate(data):
            loss = model(x).pow(2).mean() * (float("inf") if i == 2 else 1.0)  # one skipped step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (a, scale_a), (b, scale_b) = runs
    assert scale_a == scale_b
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_copying_or_pickling_the_wrapper_is_refused_with_a_clear_error():
    import copy
    import pickle

    model, _ = model_and_data()
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(model.parameters()))
    for how in (copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(TypeError, match="cannot be copied or pickled .* save opt.state_dict"):
            how(wrapped)


class FlatMomentum(torch.optim.Optimizer):
    """Heavy-ball momentum kept in one flat buffer that the step updates with one op;
    ``state[p]["m"]`` is a view into it (a multi-tensor pattern)."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))
        self.flat = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if self.flat is None:
            self.flat = torch.zeros(sum(p.numel() for p in params))
            for p, view in zip(params, self.flat.split([p.numel() for p in params])):
                self.state[p]["m"] = view.view_as(p)
        self.flat.mul_(self.defaults["beta"]).add_(torch.cat([p.grad.reshape(-1) for p in params]))
        for p in params:
            p.sub_(self.state[p]["m"], alpha=self.defaults["lr"])


def test_state_that_is_a_view_into_a_buffer_the_step_keeps_is_refused_at_the_first_step():
    # Moving each view to its own host buffer would leave the optimizer stepping its flat
    # buffer while state_dict() saved the first step's moments: a resume would go wrong.
    model, data = model_and_data()
    wrapped = StateOffloadOptimizer(FlatMomentum(model.parameters()))
    model(data[0]).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\[0\]\['m'\] is a view into a larger tensor"):
        wrapped.step()
    model(data[1]).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\[0\]\['m'\] is a view into a larger tensor"):
        wrapped.step()  # refused again, before stepping: the flat buffer is still what the step updates
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_checkpoint_whose_state_tensors_share_one_storage_loads_and_steps_exactly():
    # torch.save keeps views as views: a checkpoint written from view state loads as views
    # into one storage. AdamW steps each tensor on its own, so moving them apart is right.
    m1, data = model_and_data()
    m2, _ = model_and_data()
    source = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    train(m1, source, data[:2])
    sd = source.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([s[key].reshape(-1) for s in sd["state"].values()])
        for s, view in zip(sd["state"].values(), flat.split([s[key].numel() for s in sd["state"].values()])):
            s[key] = view.view_as(s[key])
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2))
    m2.load_state_dict(m1.state_dict())
    plain.load_state_dict(torch.load(buffer))
    buffer.seek(0)
    wrapped.load_state_dict(torch.load(buffer))
    train(m1, plain, data[2:])
    train(m2, wrapped, data[2:])
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


class OneGroupMomentum(torch.optim.Optimizer):
    """The test momentum optimizers below: one group, one lr; each writes its state its own way."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))


class AliasedMomentum(OneGroupMomentum):
    """Momentum kept under two keys of one tensor: the step writes "m", the checkpoint reads "saved"."""

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            if not state:
                state["m"] = state["saved"] = torch.zeros_like(p)
            state["m"].mul_(0.9).add_(p.grad)
            p.sub_(state["m"], alpha=self.defaults["lr"])


def test_state_tensors_sharing_one_storage_are_refused_at_the_first_step():
    model, data = model_and_data()
    wrapped = StateOffloadOptimizer(AliasedMomentum(model.parameters()))
    model(data[0]).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\[0\]\['saved'\] shares its storage with "
                                           r"AliasedMomentum's state param_groups\[0\]\[0\]\['m'\]"):
        wrapped.step()


@pytest.mark.parametrize("fails", ["host buffer", "copy"])
@pytest.mark.parametrize("call", ["step", "load_state_dict"])
def test_a_failure_while_the_state_moves_to_the_host_leaves_the_step_state(monkeypatch, fails, call):
    """Allocating a host buffer (out of memory) or issuing the copies to the host failed after
    the wrapped step: the entries already pointed at unfilled host buffers, so the step's
    momentum was lost (zeros), and the next step() went on from them without a word. Now the
    entries point at the host buffers only once every copy is issued: the state is the step's."""
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    wrapped = StateOffloadOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9))
    source = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)  # a checkpoint with momentum
    if call == "load_state_dict":
        for p in m1.parameters():
            source.state[p]["momentum_buffer"] = torch.randn(p.shape)
        plain.load_state_dict(copy.deepcopy(source.state_dict()))  # NOTE: torch keeps the tensors it loads
    if fails == "host buffer":
        real, host_buffers = torch.empty_like, []

        def alloc(t, *args, **kwargs):  # the second host buffer fails
            if kwargs.get("device") == "cpu":
                host_buffers.append(t)
                if len(host_buffers) == 2:
                    raise RuntimeError("out of memory")
            return real(t, *args, **kwargs)
        monkeypatch.setattr(torch, "empty_like", alloc)
    else:
        def copy_out(*args, **kwargs):
            raise RuntimeError("copy failed")
        monkeypatch.setattr(SyncStateCopies, "copy_out", copy_out)
    x = data[0]
    if call == "step":
        m2(x).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="out of memory|copy failed"):
        if call == "step":
            wrapped.step()
        else:
            wrapped.load_state_dict(copy.deepcopy(source.state_dict()))
    monkeypatch.undo()
    if call == "step":
        m1(x).pow(2).mean().backward()
        plain.step()
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(plain.state[p]["momentum_buffer"], wrapped.state[q]["momentum_buffer"])
    train(m1, plain, data[1:3])
    train(m2, wrapped, data[1:3])
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("replace", ["load_state_dict", "reset", "assign"])
def test_a_kept_state_dict_is_left_alone_when_the_state_is_replaced_as_in_torch(replace):
    """``state_dict()`` hands out the host buffers, and the step after a ``load_state_dict(other)``
    (or a reset, or a new tensor assigned to an entry) copied the new state into those same
    buffers: a state_dict kept from before (an in-memory "best" checkpoint) took the other
    state's moments, and loading it back later trained on a mix without a word. In torch the
    kept dict holds the tensors the state had, which the replacement leaves alone."""
    from collections import defaultdict

    def run(wrap):
        model, data = model_and_data()
        other_model, _ = model_and_data(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        other = torch.optim.AdamW(other_model.parameters(), lr=1e-2, weight_decay=0.1)
        if wrap:
            opt = StateOffloadOptimizer(opt)
        train(model, opt, data[:2])
        train(other_model, other, data[2:5])
        kept = opt.state_dict()
        if replace == "load_state_dict":
            opt.load_state_dict(copy.deepcopy(other.state_dict()))
        elif replace == "reset":
            opt.state = defaultdict(dict)
        else:
            for p, q in zip(model.parameters(), other_model.parameters()):
                opt.state[p]["exp_avg"] = other.state[q]["exp_avg"].clone()
        train(model, opt, data[2:4])
        kept_then = copy.deepcopy(kept)
        opt.load_state_dict(kept)  # back to the kept state
        train(model, opt, data[4:])
        return kept_then, [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())

    (want_kept, want_params, want_sd), (kept, params, sd) = run(False), run(True)
    for saved, expected in ((kept, want_kept), (sd, want_sd)):
        assert saved["state"].keys() == expected["state"].keys()
        for i, entry in expected["state"].items():
            for key, value in entry.items():
                assert torch.equal(saved["state"][i][key], value), (i, key)
    for a, b in zip(want_params, params):
        assert torch.equal(a, b)


def test_an_lr_scheduler_built_before_wrapping_runs_the_global_step_hooks_once():
    """An LR scheduler built on the torch optimizer patches its ``step`` on the instance; the
    wrapper then ran the global step hooks around its own step and again inside the patched
    one, so a hook that edits the weights applied twice."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def run(wrap):
        calls = []

        def decay(opt, args, kwargs):
            calls.append(type(opt).__name__)
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.mul_(0.99)

        handle = register_optimizer_step_post_hook(decay)
        try:
            model, data = model_and_data()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            if wrap:
                opt = StateOffloadOptimizer(opt)
            for x in data:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
                    scheduler.step()
        finally:
            handle.remove()
        return [p.detach().clone() for p in model.parameters()], calls, scheduler.get_last_lr()

    (want, want_calls, want_lr), (got, calls, lr) = run(False), run(True)
    assert want_calls == ["AdamW"] * 6 and calls == ["StateOffloadOptimizer"] * 6
    assert lr == want_lr
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_sparse_state_stays_on_the_device_and_steps_as_torch():
    """SGD with momentum on a sparse gradient (``nn.Embedding(sparse=True)``) keeps a sparse
    momentum buffer. The step raised "Cannot access storage of SparseTensorImpl" after the
    weights had changed, at every step. A sparse state tensor now stays where the step made
    it, with one warning naming it, and the rest of the state moves to the host as before."""
    def run(wrap):
        torch.manual_seed(0)
        model = nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "out": nn.Linear(4, 2)})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if wrap:
            opt = StateOffloadOptimizer(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in range(4):
                ids = torch.randint(10, (6,), generator=torch.Generator().manual_seed(s))
                model["out"](model["emb"](ids)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return model, opt, [str(w.message) for w in caught]

    (want, plain, _), (got, wrapped, messages) = run(False), run(True)
    for a, b in zip(want.parameters(), got.parameters()):
        assert torch.equal(a, b)
    emb, out = got["emb"].weight, got["out"].weight
    assert torch.equal(wrapped.state[emb]["momentum_buffer"].to_dense(),
                       plain.state[want["emb"].weight]["momentum_buffer"].to_dense())
    assert wrapped.state[emb]["momentum_buffer"].is_sparse
    assert wrapped.state[out]["momentum_buffer"] is state_staging_of(wrapped).host[(id(out), "momentum_buffer")]
    sparse = [m for m in messages if "sparse" in m]
    assert len(sparse) == 1 and "param_groups[0][0]['momentum_buffer']" in sparse[0], messages


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps, lr=0.5, max_iter=4, history_size=3),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
], ids=["LBFGS", "AdamW"])
def test_ctrl_c_inside_a_closure_interrupts_it_at_once_as_in_torch(make):
    """``step(closure)`` deferred Ctrl-C for the whole step, the user's closure included (Lightning
    runs each training_step there): a closure that blocked could not be interrupted. The closure
    now runs with Ctrl-C delivered at once; the state is then where torch leaves it."""
    import signal

    def run(wrap):
        model, data = model_and_data()
        opt = make(model.parameters())
        if wrap:
            opt = StateOffloadOptimizer(opt)
        closure_steps(model, opt, data[:2])
        calls, finished = [], []

        def closure():
            opt.zero_grad()
            loss = model(data[2]).pow(2).mean()
            loss.backward()
            calls.append(1)
            if len(calls) == 2 or not isinstance(opt.optimizer if wrap else opt, torch.optim.LBFGS):
                signal.raise_signal(signal.SIGINT)
                for _ in range(100):  # a closure that would block: the interrupt lands here
                    time.sleep(0.01)
                finished.append(True)
            return loss

        with pytest.raises(KeyboardInterrupt):
            opt.step(closure)
        assert not finished
        closure_steps(model, opt, data[3:])
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


class OutOfPlaceMomentum(OneGroupMomentum):
    """Momentum written out of place: each step puts a new tensor under "m"."""

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            state["m"] = 0.9 * state["m"] + p.grad if state else p.grad.clone()
            p.sub_(state["m"], alpha=self.defaults["lr"])


def test_a_state_tensor_replaced_each_step_reuses_its_buffer_unless_something_holds_it():
    """A state tensor the step makes anew gets a new host buffer only while something else holds
    the old one: an optimizer that writes its state out of place took a new (on a GPU, pinned)
    buffer at every step, twice the host memory in the caching allocator. A tensor read from
    ``opt.state`` and kept is left as it was, as in torch."""
    m1, data = model_and_data()
    m2, _ = model_and_data()
    plain, wrapped = OutOfPlaceMomentum(m1.parameters()), StateOffloadOptimizer(OutOfPlaceMomentum(m2.parameters()))
    staging = state_staging_of(wrapped)
    kept = []  # per step: which buffers are the previous step's (weak references: they must not hold them)
    previous = {}
    for s, x in enumerate(data[:5]):
        for model, opt in ((m1, plain), (m2, wrapped)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        kept.append({key: key in previous and previous[key]() is host for key, host in staging.host.items()})
        previous = {key: weakref.ref(host) for key, host in staging.host.items()}
        if s == 2:
            p = next(m2.parameters())
            held, held_values = wrapped.state[p]["m"], wrapped.state[p]["m"].clone()
        if s == 3:
            q, r = list(m2.parameters())[1:3]
            view, view_values = wrapped.state[q]["m"][1:], wrapped.state[q]["m"][1:].clone()
            detached, detached_values = wrapped.state[r]["m"].detach(), wrapped.state[r]["m"].clone()
    assert len(kept[0]) == 4 and not any(kept[0].values())
    assert all(kept[1].values()) and all(kept[2].values())
    assert not kept[3][(id(p), "m")] and sum(kept[3].values()) == 3  # the held buffer was not reused
    assert not kept[4][(id(q), "m")] and not kept[4][(id(r), "m")] and sum(kept[4].values()) == 2  # nor those
    assert torch.equal(held, held_values) and torch.equal(view, view_values) and torch.equal(detached, detached_values)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["load_state_dict", "reset", "del"])
def test_host_buffers_of_state_that_is_gone_are_freed(how):
    """After a load of a checkpoint without some parameters' state, a reset or ``del
    opt.state[p]``, the host buffers (pinned, on a GPU) of state that was not made again stayed
    for good, and ``stats()["host_bytes"]`` went on counting them."""
    from collections import defaultdict

    model, data = model_and_data()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2).state_dict()
    opt = StateOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(model, opt, data[:2])
    if how == "load_state_dict":
        opt.load_state_dict(fresh)
    elif how == "reset":
        opt.state = defaultdict(dict)
    else:
        for p in model[0].parameters():
            del opt.state[p]
    for p in model[0].parameters():  # no longer trained: its state is not made again
        p.requires_grad_(False)
    train(model, opt, data[2:3])
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert state_bytes > 0 and opt.stats()["host_bytes"] == state_bytes
    held = state_staging_of(opt).host
    assert {key for key in held} == {(id(p), key) for p in model[2].parameters() for key in ("exp_avg", "exp_avg_sq")}
