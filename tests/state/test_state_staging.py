# The "optimizer" mode's prefetch during backward and copy-out after step(), on
# CPU parameters (the synchronous fallback runs the same bookkeeping as CUDA):
# bit-identical to the unwrapped optimizer for several optimizers, with gradient
# accumulation, a parameter without gradients, clipping, a state_dict round trip
# in the middle of a step, an exception in the middle of backward; the cap; the
# order of the hand-offs (copy-in after the buffer's copy-out, step after every
# copy-in, copy-out after the step); stats(); a Ctrl-C at any line of step() or
# load_state_dict() (the step taken whole or not at all, the load all or nothing) or of a
# backward's hooks.
import copy
import gc
import io

import pytest
import torch

from cpu_offload import StateOffloadOptimizer, offload_optimizer
from cpu_offload._common.dtensor import local_of
from cpu_offload._state.copies import SyncStateCopies
from helpers import Boom, sharded_state_nets, sigint_at_line, state_staging_of
from helpers import StateNet as Net

CPU = torch.device("cpu")


class HeavyBall(torch.optim.Optimizer):
    """One state tensor per parameter, created at its first gradient."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("buf")
                if buf is None:
                    buf = self.state[p]["buf"] = p.grad.clone()
                else:
                    buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "heavy_ball": lambda ps: HeavyBall(ps),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # state made at construction, on the device
}


def batch(step, micro=0):
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(100 * step + micro))


def backward(model, step, micro=0):
    model(batch(step, micro)).pow(2).mean().backward()


def train(model, opt, steps, accum=1, clip=None):
    for s in steps:
        for m in range(accum):
            backward(model, s, m)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # gradients stay on the device
        opt.step()
        opt.zero_grad()


def pair(kind, **options):
    """(plain model, plain optimizer, model, wrapped optimizer), equal at the start."""
    m1, m2 = Net(), Net()
    return m1, OPTIMIZERS[kind](m1.parameters()), m2, StateOffloadOptimizer(OPTIMIZERS[kind](m2.parameters()), **options)


def assert_same(m1, plain, m2, wrapped):
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(m1.parameters(), m2.parameters()):
        sa, sb = plain.state.get(a, {}), wrapped.state.get(b, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), key
                if sb[key].dim():
                    assert sb[key] is state_staging_of(wrapped).host[(id(b), key)]  # between steps: the host buffer
            else:
                assert sa[key] == sb[key], key


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim())


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_bitwise_equal_to_the_wrapped_optimizer(kind):
    m1, plain, m2, wrapped = pair(kind)
    train(m1, plain, range(5), clip=0.5)
    train(m2, wrapped, range(5), clip=0.5)
    assert_same(m1, plain, m2, wrapped)
    stats = wrapped.stats()
    # everything with state was prefetched during backward; "unused" has no state
    # (Adagrad's, made at construction, is copied in by step())
    unused = 0 if kind != "adagrad" else sum(v.numel() * 4 for v in [m2.unused.weight, m2.unused.bias])
    assert stats["step_copied_bytes"] == unused
    assert stats["prefetched_bytes"] == stats["d2h_bytes"] - unused > 0
    assert stats["h2d_bytes"] == stats["d2h_bytes"] == state_bytes(wrapped)


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum", "heavy_ball"])
@pytest.mark.parametrize("accum,declared", [(3, 3), (3, 1), (2, 4)])
def test_accumulation_copies_each_state_once(kind, accum, declared):
    m1, plain, m2, wrapped = pair(kind, grad_accum_steps=declared)
    train(m1, plain, range(4), accum=accum)
    train(m2, wrapped, range(4), accum=accum)
    assert_same(m1, plain, m2, wrapped)
    stats = wrapped.stats()
    assert stats["h2d_bytes"] == stats["d2h_bytes"] == state_bytes(wrapped)  # once per step, either way
    if declared <= accum:
        assert stats["prefetched_bytes"] == stats["h2d_bytes"]
    else:  # the window was shorter than declared: step() copied it all in
        assert stats["prefetched_bytes"] == 0 and stats["step_copied_bytes"] == stats["h2d_bytes"]


def prefetched_after_each_backward(model, opt, step, accum):
    """How many parameters' state had been copied in after each backward of one window."""
    counts = []
    for m in range(accum):
        backward(model, step, m)
        counts.append(len(state_staging_of(opt).prefetched))
    opt.step()
    opt.zero_grad()
    return counts


def test_prefetch_starts_with_the_last_backward_of_the_window():
    _, _, model, opt = pair("adamw", grad_accum_steps=2)
    train(model, opt, range(1), accum=2)
    assert prefetched_after_each_backward(model, opt, 1, 2) == [0, 4]


def test_window_length_is_learned_when_not_given():
    """Without grad_accum_steps, the longest window completed so far: nothing is
    prefetched in the first window, a short window is copied in by step(), and
    a backward that raised does not count."""
    m1, plain, model, opt = pair("adamw")
    assert prefetched_after_each_backward(model, opt, 0, 3) == [0, 0, 0]
    assert prefetched_after_each_backward(model, opt, 1, 3) == [0, 0, 4]
    assert prefetched_after_each_backward(model, opt, 2, 2) == [0, 0]  # a short last window
    assert opt.stats()["step_copied_bytes"] == opt.stats()["h2d_bytes"] > 0
    Boom.armed = RuntimeError("boom")
    try:
        with pytest.raises(RuntimeError, match="boom"):
            backward(model, 3, 0)
    finally:
        Boom.armed = None
    assert state_staging_of(opt).completed == 0
    assert prefetched_after_each_backward(model, opt, 3, 3) == [0, 0, 4]
    assert state_staging_of(opt).window == 3
    for s, accum in enumerate([3, 3, 2, 3]):
        if s == 3:  # b's gradients of the backward that raised stay in b.grad
            Boom.armed = RuntimeError("boom")
            try:
                with pytest.raises(RuntimeError, match="boom"):
                    backward(m1, 3, 0)
            finally:
                Boom.armed = None
        for m in range(accum):
            backward(m1, s, m)
        plain.step()
        plain.zero_grad()
    assert_same(m1, plain, model, opt)


B_STATE = (16 * 4 + 4) * 2 * 4  # AdamW's two fp32 moments of layer b, whose gradients come first


@pytest.mark.parametrize("cap", [0, B_STATE, B_STATE + 127, None])
def test_cap_on_prefetched_bytes(cap):
    m1, plain, m2, wrapped = pair("adamw", prefetch_bytes=cap)
    train(m1, plain, range(3))
    train(m2, wrapped, range(3))
    assert_same(m1, plain, m2, wrapped)
    stats = wrapped.stats()
    total = state_bytes(wrapped)
    assert stats["prefetched_bytes"] + stats["step_copied_bytes"] == stats["h2d_bytes"] == total
    assert stats["prefetched_bytes"] == (total if cap is None else B_STATE if cap else 0)  # a.bias's 128 B do not fit


def test_state_dict_round_trips_between_backward_and_step():
    """The copies made during backward are dropped by state_dict()/load_state_dict;
    the step then copies the (possibly edited) host state in again."""
    m1, plain, m2, wrapped = pair("adamw")
    train(m1, plain, range(2))
    train(m2, wrapped, range(2))
    for model, opt in ((m1, plain), (m2, wrapped)):
        backward(model, 2)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf)
        for st in sd["state"].values():
            st["exp_avg"].mul_(0.5)  # a visible change
        opt.load_state_dict(sd)
        opt.step()
        opt.zero_grad()
    assert wrapped.stats()["prefetched_bytes"] == 0
    assert_same(m1, plain, m2, wrapped)
    train(m1, plain, range(3, 5))
    train(m2, wrapped, range(3, 5))
    assert_same(m1, plain, m2, wrapped)


def test_edits_through_state_between_backward_and_step_are_seen():
    m1, plain, m2, wrapped = pair("sgd_momentum")
    train(m1, plain, range(2))
    train(m2, wrapped, range(2))
    for model, opt in ((m1, plain), (m2, wrapped)):
        backward(model, 2)
        opt.state[model.b.weight]["momentum_buffer"].zero_()
        opt.step()
        opt.zero_grad()
    assert_same(m1, plain, m2, wrapped)


@pytest.mark.parametrize("then", ["zero_grad", "step"])
def test_exception_in_the_middle_of_backward(then):
    m1, plain, m2, wrapped = pair("adamw")
    train(m1, plain, range(2))
    train(m2, wrapped, range(2))
    for model, opt in ((m1, plain), (m2, wrapped)):
        Boom.armed = RuntimeError("boom")
        try:
            with pytest.raises(RuntimeError, match="boom"):
                backward(model, 2)  # b's gradients (and its prefetch) came before the error
        finally:
            Boom.armed = None
        if then == "step":
            opt.step()  # steps b only, as torch does
        opt.zero_grad()
    assert id(m2.b.weight) in state_staging_of(wrapped).prefetched or then == "step"
    train(m1, plain, range(3, 6))
    train(m2, wrapped, range(3, 6))
    assert_same(m1, plain, m2, wrapped)
    assert wrapped.stats()["h2d_bytes"] == state_bytes(wrapped)  # no stale or double copy


def test_hand_offs_happen_in_order():
    """Copy-in of a buffer after its last copy-out; all copy-ins, then the wait,
    then the step, then the copy-outs."""
    log = []

    class Recording(SyncStateCopies):
        def copy_in(self, hosts, after=None):
            log.append(("in", {id(h) for h in hosts}, after))
            return super().copy_in(hosts, after)

        def compute_waits_for_copy_ins(self, timed=False):
            log.append(("wait",))

        def copy_out(self, groups, overlap_bytes=0):
            super().copy_out(groups, overlap_bytes)
            jobs = [("out", len(log), frozenset(id(h) for h, _ in pairs)) for pairs in groups]
            log.extend(jobs)
            return jobs, None

    _, _, model, opt = pair("adamw")
    state_staging_of(opt).copies[CPU] = Recording(CPU)
    opt.optimizer.register_step_pre_hook(lambda *a: log.append(("step",)))
    train(model, opt, range(3))
    kinds = [entry[0] for entry in log]
    # step 1 has no state to copy in; steps 2 and 3 copy in the 4 parameters' state during backward
    assert kinds == ["wait", "step"] + ["out"] * 4 + 2 * (["in"] * 4 + ["wait", "step"] + ["out"] * 4)
    for i, entry in enumerate(log):
        if entry[0] == "in":  # waited for the copy-out that last wrote its buffers
            last = [e for e in log[:i] if e[0] == "out" and entry[1] <= e[2]][-1]
            assert entry[2] == last


def test_params_added_or_unfrozen_later_are_prefetched():
    m1, m2 = Net(), Net()
    for m in (m1, m2):
        m.b.weight.requires_grad_(False)
    plain = torch.optim.AdamW([m1.a.weight, m1.a.bias, m1.b.weight], lr=1e-2)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW([m2.a.weight, m2.a.bias, m2.b.weight], lr=1e-2))
    plain.add_param_group({"params": [m1.b.bias], "lr": 1e-3})
    wrapped.add_param_group({"params": [m2.b.bias], "lr": 1e-3})
    train(m1, plain, range(2))
    train(m2, wrapped, range(2))
    for m in (m1, m2):
        m.b.weight.requires_grad_(True)
    train(m1, plain, range(2, 5))
    train(m2, wrapped, range(2, 5))
    assert_same(m1, plain, m2, wrapped)
    assert wrapped.stats()["prefetched_bytes"] == state_bytes(wrapped)


def test_hooks_go_with_the_optimizer():
    model = Net()
    opt = StateOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(model, opt, range(1))
    assert len(model.a.weight._post_accumulate_grad_hooks) == 1
    del opt
    gc.collect()
    assert not model.a.weight._post_accumulate_grad_hooks
    backward(model, 1)  # nothing left that could fail


def test_options_are_checked():
    for bad in (-1, 1.5, True, "1GiB"):
        with pytest.raises(ValueError, match="prefetch_bytes must be None"):
            StateOffloadOptimizer(torch.optim.SGD(Net().parameters(), lr=1.0), prefetch_bytes=bad)
    for bad in (0, 2.0, False):
        with pytest.raises(ValueError, match="grad_accum_steps must be None or an int >= 1"):
            StateOffloadOptimizer(torch.optim.SGD(Net().parameters(), lr=1.0), grad_accum_steps=bad)
    opt = offload_optimizer(torch.optim.SGD(Net().parameters(), lr=1.0), grad_accum_steps=3, prefetch_bytes=0)
    assert state_staging_of(opt).grad_accum_steps == 3 and state_staging_of(opt).prefetch_bytes == 0


def test_stats_before_and_after_a_step():
    _, _, model, opt = pair("adamw")
    assert opt.stats() == {"h2d_bytes": 0, "d2h_bytes": 0, "prefetched_bytes": 0, "step_copied_bytes": 0,
                           "overlapped_d2h_bytes": 0, "step_blocked_s": 0.0, "copy_wait_s": 0.0, "host_bytes": 0}
    train(model, opt, range(2))
    stats = opt.stats()
    assert stats["host_bytes"] == state_bytes(opt) == stats["d2h_bytes"]
    assert stats["overlapped_d2h_bytes"] == 0  # CPU parameters: plain synchronous copies
    assert stats["step_blocked_s"] > 0 and stats["copy_wait_s"] == 0.0


# ------------------------------------------------------------------- FSDP2

def test_fsdp2_dtensor_params(gloo_group):
    m1, m2 = sharded_state_nets()
    plain = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = StateOffloadOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1))
    train(m1, plain, range(4), accum=2, clip=0.5)
    train(m2, wrapped, range(4), accum=2, clip=0.5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
        if a is m1.unused.weight or a is m1.unused.bias:
            assert b not in wrapped.state  # no gradient, no state
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            value = wrapped.state[b][key]
            assert type(value).__name__ == "DTensor" and local_of(value) is state_staging_of(wrapped).host[(id(b), key)]
            assert torch.equal(plain.state[a][key].to_local(), value.to_local())
    stats = wrapped.stats()
    assert stats["prefetched_bytes"] == stats["h2d_bytes"] == stats["d2h_bytes"] > 0  # FSDP2 ran the hooks


def is_same(m1, plain, m2, wrapped) -> bool:
    try:
        assert_same(m1, plain, m2, wrapped)
    except AssertionError:
        return False
    return True


def ctrl_c_at_each_line(kind, interrupted, before=lambda m1, plain, m2, wrapped: None):
    """For k = 1, 2, ...: a fresh pair trained alike for two steps, ``it = before(m1, plain, m2,
    wrapped)`` run whole, then ``interrupted(wrapped, it)`` with a Ctrl-C at its k-th package
    line. Yields (m1, plain, m2, wrapped, it) after each call the Ctrl-C stopped; ends with the
    first call that ran to its end."""
    k = 0
    while True:
        k += 1
        m1, plain, m2, wrapped = pair(kind)
        train(m1, plain, [0, 1])
        train(m2, wrapped, [0, 1])
        it = before(m1, plain, m2, wrapped)
        hit, raised = sigint_at_line(k, lambda w=wrapped, it=it: interrupted(w, it))
        if not hit:
            return
        assert isinstance(raised, KeyboardInterrupt), (k, raised)
        yield m1, plain, m2, wrapped, it


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_a_ctrl_c_at_any_line_of_step_takes_the_step_whole_or_not_at_all(sigint_raises, kind):
    """Before, a Ctrl-C after the copy-out had pointed a state entry at its host buffer but
    before the copy into it left the weights stepped and that parameter's moments as they
    were, with nothing said."""
    def backward_both(m1, plain, m2, wrapped):
        backward(m1, 2)
        backward(m2, 2)

    outcomes = []
    for m1, plain, m2, wrapped, _ in ctrl_c_at_each_line(kind, lambda w, _: w.step(), backward_both):
        if is_same(m1, plain, m2, wrapped):  # not taken: the gradients are still there to step on
            outcomes.append("not taken")
            wrapped.step()
        else:
            outcomes.append("whole")
        plain.step()
        assert_same(m1, plain, m2, wrapped)
        plain.zero_grad()
        wrapped.zero_grad()
        train(m1, plain, [3])
        train(m2, wrapped, [3])
        assert_same(m1, plain, m2, wrapped)
    assert len(outcomes) > 100 and set(outcomes) == {"not taken", "whole"}


def test_a_ctrl_c_at_any_line_of_load_state_dict_loads_all_or_nothing(sigint_raises):
    """Before, a Ctrl-C in the middle of the load left some parameters' state loaded and
    others not, with nothing said."""
    def save_then_train(m1, plain, m2, wrapped):
        saved = copy.deepcopy(wrapped.state_dict())  # NOTE: copied per load: torch may adopt its tensors
        train(m1, plain, [2])
        train(m2, wrapped, [2])
        return saved

    outcomes = []
    for m1, plain, m2, wrapped, saved in ctrl_c_at_each_line(
            "adamw", lambda w, saved: w.load_state_dict(copy.deepcopy(saved)), save_then_train):
        if is_same(m1, plain, m2, wrapped):  # untouched: load again
            outcomes.append("untouched")
            wrapped.load_state_dict(copy.deepcopy(saved))
        else:
            outcomes.append("loaded")
        plain.load_state_dict(copy.deepcopy(saved))
        assert_same(m1, plain, m2, wrapped)
        assert wrapped.param_groups is wrapped.optimizer.param_groups
        train(m1, plain, [3])
        train(m2, wrapped, [3])
        assert_same(m1, plain, m2, wrapped)
    assert len(outcomes) > 100 and set(outcomes) == {"untouched", "loaded"}


def test_a_ctrl_c_at_any_line_of_close_closes_whole_or_not_at_all(sigint_raises):
    """close() removes the hooks, releases the torch optimizer and its parameters: a Ctrl-C
    inside it leaves all of that done (a new wrapper takes the optimizer) or none of it (the
    wrapper trains on), and either way the training equals the plain optimizer's."""
    outcomes = []
    for m1, plain, m2, wrapped, _ in ctrl_c_at_each_line("adamw", lambda w, _: w.close()):
        if state_staging_of(wrapped).closed:
            outcomes.append("closed")
            assert not state_staging_of(wrapped).handles
            wrapped = StateOffloadOptimizer(wrapped.optimizer)
        else:
            outcomes.append("open")
        train(m1, plain, [2])
        train(m2, wrapped, [2])
        assert_same(m1, plain, m2, wrapped)
    assert len(outcomes) > 3 and set(outcomes) == {"open", "closed"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the finalizer's, below
def test_a_ctrl_c_at_any_line_of_a_backward_then_the_batch_again_trains_exactly(sigint_raises):
    """A CPU backward runs the prefetch hooks on the main thread: a Ctrl-C at any of their lines,
    then zero_grad() and the batch again, trains as the plain optimizer does."""
    k = 0
    while True:
        k += 1
        m1, plain, m2, wrapped = pair("adamw", grad_accum_steps=1)
        train(m1, plain, [0, 1])
        train(m2, wrapped, [0, 1])
        hit, raised = sigint_at_line(k, lambda m=m2: backward(m, 2))
        if not hit:
            break
        # NOTE: None: the interrupt landed in a finalizer (``__del__``), where Python prints it
        # and drops it; the backward then ran to its end
        assert raised is None or isinstance(raised, KeyboardInterrupt), (k, raised)
        wrapped.zero_grad()
        train(m1, plain, [2, 3])
        train(m2, wrapped, [2, 3])
        assert_same(m1, plain, m2, wrapped)
    assert k > 20
