# Full offload's validated step under conditions outside the common path: clipping in a
# short accumulation window, Ctrl-C during the rollback of a clipped step, load_state_dict
# between the last backward and step(), a factor of an abandoned window, a late tiny
# factor on huge gradients, and bf16 moments with an eps too small to roll back. Each
# case is compared with torch.optim.AdamW fed the same gradients where torch defines it.
import copy
import signal
import warnings

import pytest
import torch
import torch.nn as nn

import cpu_offload
from cpu_offload._full import chunk_runner
from cpu_offload._full import validation as step_validation
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from helpers import HALF_STATE, SMALL, PlainNet, records_of

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make(seed=0, **opts):
    """A fresh model (seeded), its initial fp32 weights, the wrapper and a gradient log."""
    torch.manual_seed(seed)
    model = PlainNet()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads: dict = {}
    for n, p in model.named_parameters():  # registered first: runs before the offload hook
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: grads.setdefault(n, []).append(p.grad.detach().float().clone()))
    opt = torch.optim.AdamW(model.parameters(), **HP)
    off = FullCPUOffloadOptimizer(opt, **SMALL, **opts)
    return model, init, off, grads


def backward(model, seed, factor=1.0):
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(seed))
    (model(x.to(torch.bfloat16)).float().pow(2).mean() * factor).backward()


class Reference:
    """torch.optim.AdamW on fp32 copies of the initial weights."""

    def __init__(self, init):
        self.params = {n: nn.Parameter(t.float().clone()) for n, t in init.items()}
        self.opt = torch.optim.AdamW(self.params.values(), **HP)

    def step(self, grads, *, clip=None, scale=1.0):
        for n, p in self.params.items():
            p.grad = sum(grads[n][1:], grads[n][0].clone()) * scale
        norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), clip) if clip is not None else None
        self.opt.step()
        return norm


def normwise(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_matches(model, off, ref, tol=1e-5):
    names = {id(p): n for n, p in model.named_parameters()}
    for rec in records_of(off):
        n = names[id(rec.param)]
        p, st = ref.params[n], ref.opt.state[ref.params[n]]
        assert normwise(rec.master.view(rec.shape), p.detach()) < tol, n
        assert normwise(rec.exp_avg.view(rec.shape), st["exp_avg"]) < tol, n
        assert normwise(rec.exp_avg_sq.view(rec.shape), st["exp_avg_sq"]) < tol, n
        assert rec.step == int(st["step"]), n
        assert torch.equal(rec.param.detach(), rec.master.view(rec.shape).to(torch.bfloat16)), n


def snapshot(off):
    return [(r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), r.step, r.param.detach().clone())
            for r in records_of(off)]


def assert_same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        for u, v in zip(x, y):
            assert (u == v) if isinstance(u, int) else torch.equal(u, v), i


# ----------------------------------------------------------------- 1: short windows
@pytest.fixture
def slow_accumulation(monkeypatch):
    """Slows the worker's accumulation, so a read of the accumulators that does not wait
    for it sees a partial sum."""
    real = chunk_runner.kernels.accumulate_

    def slow(*args, **kwargs):
        import time
        time.sleep(0.05)
        real(*args, **kwargs)

    monkeypatch.setattr(chunk_runner.kernels, "accumulate_", slow)


@pytest.mark.parametrize("passes", [1, 2])
def test_clipping_in_a_short_window_reads_the_whole_sum(slow_accumulation, passes):
    model, init, off, grads = make(grad_accum_steps=3)
    ref = Reference(init)
    for s in range(3):
        grads.clear()
        for j in range(passes):
            backward(model, 10 * s + j)
        norm = off.clip_grad_norm_(1e-3)
        off.step()
        off.zero_grad()
        expected = ref.step(grads, clip=1e-3)
        assert abs(float(norm) - float(expected)) <= 1e-6 * float(expected), (s, float(norm), float(expected))
    assert_matches(model, off, ref)


def test_clipping_in_the_middle_of_a_window_scales_what_was_accumulated(slow_accumulation):
    """As torch: clip_grad_norm_ after pass 1 of 3 scales the sum so far; passes 2 and 3 add."""
    model, init, off, grads = make(grad_accum_steps=3)
    ref = Reference(init)
    backward(model, 1)
    norm = off.clip_grad_norm_(1e-3)
    first = {n: g[0].clone() for n, g in grads.items()}
    torch_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in first.values()]))
    assert abs(float(norm) - float(torch_norm)) <= 1e-6 * float(torch_norm)
    coef = min(1.0, 1e-3 / (float(torch_norm) + 1e-6))
    backward(model, 2)
    backward(model, 3)
    off.step()
    grads = {n: [first[n] * coef] + g[1:] for n, g in grads.items()}
    ref.step(grads)
    assert_matches(model, off, ref)


# ------------------------------------------------------ 2: Ctrl-C during the rollback
def clipped_run(steps, interrupt_at=None, at_step=None):
    """Every step clips (1e-4); SIGINT is delivered at call ``interrupt_at`` of the
    rollback loop of step ``at_step``. Returns the wrapper's state and what raised."""
    model, init, off, grads = make(grad_copy="host")
    raised = []
    real = step_validation.rollback_adamw_pieces_
    calls = {"n": 0, "armed": False}

    def rollback(*args, **kwargs):
        if calls["armed"]:
            if calls["n"] == interrupt_at:
                signal.raise_signal(signal.SIGINT)  # in this thread, the one Python handles it on
            calls["n"] += 1
        return real(*args, **kwargs)

    step_validation.rollback_adamw_pieces_ = rollback
    try:
        for s in range(steps):
            backward(model, s)
            off.clip_grad_norm_(1e-4)
            calls["armed"] = s == at_step
            try:
                off.step()
            except KeyboardInterrupt:
                raised.append(s)
            calls["armed"] = False
            off.zero_grad()
    finally:
        step_validation.rollback_adamw_pieces_ = real
    return off, raised, calls


def test_sigint_at_each_call_of_the_rollback_leaves_the_completed_step(sigint_raises):
    # NOTE: step 0 is the one rolled back: it speculated with factor 1; the later ones are
    # deferred (stepped once with their coefficient), so they have nothing to roll back.
    steps = 3
    plain, raised, _ = clipped_run(steps)
    assert raised == []
    expected = snapshot(plain)
    _, _, calls = clipped_run(steps, interrupt_at=-1, at_step=0)
    pieces = calls["n"]
    assert pieces >= 1  # one native call per group of stepped pieces
    for k in range(pieces):
        off, raised, _ = clipped_run(steps, interrupt_at=k, at_step=0)
        assert raised == [0], k  # the interrupt is delivered, after the step completed
        assert_same(snapshot(off), expected)


# ------------------------------------ 4: load_state_dict between backward and step()
def checkpoint_of(off):
    """A snapshot of ``off.state_dict()`` (its tensors are live views of the host state)."""
    return copy.deepcopy(off.state_dict())


def refused(saved):
    """``saved`` with a learning rate full offload refuses."""
    return dict(saved, param_groups=[dict(g, lr=-1.0) for g in saved["param_groups"]])


@pytest.mark.parametrize("opts", [{}, {"gpu_state": HALF_STATE}], ids=["host", "half_on_the_device"])
@pytest.mark.parametrize("which", ["valid", "refused"])
def test_load_state_dict_after_the_last_backward_raises_and_changes_nothing(which, opts):
    """The window's update ran during its last backward, so a loaded state could not be what
    step() steps, as torch's would be: the load raises, naming what to call first, and changes
    nothing. The step() after it is the one the run makes without the load, an lr set after
    the backward included. Before, the load closed the window with the backward's lr (the
    late one was lost) and then loaded or refused the dict: the step() after it found no
    gradient, and the masters were those of another step."""
    runs = []
    for attempt in (False, True):
        model, init, off, grads = make(**opts)
        backward(model, 0)
        off.step()
        off.zero_grad()
        saved = checkpoint_of(off)
        backward(model, 1)
        for g in off.param_groups:
            g["lr"] *= 0.1  # set after the last backward: the step applies it (a redo)
        if attempt:
            with pytest.raises(RuntimeError, match=r"load_state_dict\(\) after the window's last backward.*"
                                                   r"Call step\(\).*or zero_grad\(\)"):
                off.load_state_dict(saved if which == "valid" else refused(saved))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "found no gradient" warning: the window is still there
            warnings.filterwarnings("ignore", "cpu_offload: param_groups.*changed from", RuntimeWarning)
            off.step()
        off.zero_grad()
        backward(model, 2)
        off.step()
        runs.append(snapshot(off))
        off.close()
    assert_same(runs[1], runs[0])


def test_load_state_dict_after_zero_grad_replaces_the_window_after_the_last_backward():
    """What the refused load would have meant, asked for: zero_grad() drops the window (its
    update stays applied, with a warning), and the load then replaces it."""
    model, init, off, grads = make()
    backward(model, 0)
    off.step()
    off.zero_grad()
    saved = checkpoint_of(off)
    backward(model, 1)
    with pytest.warns(RuntimeWarning, match="zero_grad\\(\\) without step\\(\\)"):
        off.zero_grad()
    off.load_state_dict(saved)
    backward(model, 2)
    off.step()
    other, init2, off2, grads2 = make()
    backward(other, 0)
    off2.step()
    off2.zero_grad()
    backward(other, 2)
    off2.step()
    assert_same(snapshot(off), snapshot(off2))


# ------------------------------------------ 5: a factor of an abandoned window
@pytest.mark.parametrize("k, passes", [(1, 0), (2, 1)])
def test_zero_grad_drops_the_factor_of_an_abandoned_window(k, passes):
    model, init, off, grads = make(grad_accum_steps=k)
    ref = Reference(init)
    off.scale_grads_(0.5)
    for j in range(passes):
        backward(model, 100 + j)
    off.zero_grad()
    grads.clear()
    off.scale_grads_(0.25)
    for j in range(k):
        backward(model, j)
    off.step()
    ref.step(grads, scale=0.25)
    assert_matches(model, off, ref)


# ------------------------------------- 6: a late tiny factor on huge gradients
@pytest.mark.parametrize("grad_copy", ["host", "device"])
def test_late_tiny_factor_on_huge_gradients_stays_finite_like_torch(grad_copy):
    model, init, off, grads = make(grad_copy=grad_copy)
    ref = Reference(init)
    for s in range(3):  # a normal step first: the state to roll back is not zero
        grads.clear()
        factor = 1e30 if s == 2 else 1.0
        backward(model, s, factor)
        if s == 2:
            off.scale_grads_(1e-30)
        off.step()
        off.zero_grad()
        ref.step(grads, scale=1e-30 if s == 2 else 1.0)
    for rec in records_of(off):
        assert torch.isfinite(rec.master).all() and torch.isfinite(rec.exp_avg_sq).all(), rec.name
    assert_matches(model, off, ref, tol=1e-5)


# ----------------------------- 7: bf16 moments with an eps too small to roll back
def test_bf16_moments_refuse_an_eps_the_rollback_cannot_honour():
    torch.manual_seed(0)
    model = PlainNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-20)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\]"):
        cpu_offload.offload_optimizer(opt, offload="full", state_dtype=torch.bfloat16, **SMALL)
    ok = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8), offload="full",
                                       state_dtype=torch.bfloat16, **SMALL)
    ok.param_groups[0]["eps"] = 1e-20  # changed later: refused before anything is stepped
    before = snapshot(ok)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\]"):
        backward(model, 0)
    ok.zero_grad()
    assert_same(snapshot(ok), before)


def rollback_error(eps, grad):
    """Max |p0 - rollback(step(p0))| / |u| over a second AdamW step with bf16 moments."""
    from cpu_offload import kernels
    from cpu_offload._full.rollback import rollback_adamw_

    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=eps, weight_decay=0.0)
    p = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(1))
    m, v = torch.zeros(grad.numel(), dtype=torch.bfloat16), torch.zeros(grad.numel(), dtype=torch.bfloat16)
    steps = torch.zeros(1, dtype=torch.int64)
    kernels.adamw_step([p], [grad], [m], [v], steps, **hp)  # NOTE: a first step is undone from zero moments
    p0 = p.clone()
    kernels.adamw_step([p], [grad], [m], [v], steps, **hp)
    u = (p - p0).abs()
    rollback_adamw_(p, grad, m, v, 2, **hp)
    beyond_rounding = ((p - p0).abs() - p0.abs() * 2**-23).clamp_min(0)
    return float((beyond_rounding / u).max())


def test_bf16_moments_eps_bound_is_what_the_rollback_needs():
    """Gradients whose v = (1-b2)*g*g lies in bf16's subnormal range keep a few bits of v:
    below the bound the undone update is far off; at the bound within 2**-8 of it."""
    from cpu_offload._full.options import _BF16_MIN_EPS_HAT

    g = torch.rand(4096, generator=torch.Generator().manual_seed(0)).add_(0.5).mul_(5e-20)
    smallest = _BF16_MIN_EPS_HAT / (1 - 0.95) ** 0.5
    assert rollback_error(1e-25, g) > 0.05
    assert rollback_error(smallest, g) <= 2**-8


def test_zero_filled_parameters_are_redone_with_accumulation():
    """zero_grad(set_to_none=False): a parameter without a gradient in a later window is
    stepped with zeros, as torch steps it; a late clip redoes it with the others."""

    class WithExtra(PlainNet):
        def __init__(self):
            super().__init__()
            self.extra = nn.Parameter(torch.randn(8) * 0.1)

        def forward(self, x, use_extra=False):
            y = super().forward(x)
            return y * self.extra if use_extra else y

    torch.manual_seed(0)
    model = WithExtra()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    off = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), **HP), grad_accum_steps=2, **SMALL)
    ref_model = WithExtra()
    ref_model.load_state_dict(init)
    ref = torch.optim.AdamW(ref_model.parameters(), **HP)
    for s in range(3):
        for j in range(2):
            x = torch.randn(16, 24, generator=torch.Generator().manual_seed(10 * s + j))
            model(x.to(torch.bfloat16), use_extra=s == 0).float().pow(2).sum().backward()
            ref_model(x.to(torch.bfloat16).float(), use_extra=s == 0).pow(2).sum().backward()
        assert float(off.clip_grad_norm_(0.01)) > 0.01
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
        off.step()
        ref.step()
        off.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    extra = next(r for r in records_of(off) if r.param is model.extra)
    assert extra.step == 3 == int(ref.state[ref_model.extra]["step"])
    assert normwise(extra.master, ref_model.extra.detach()) < 1e-5


def test_step_blocked_time_counts_a_redo_once(monkeypatch):
    """stats()["step_blocked_s"]: the redo inside step() is part of step()'s own time, once."""
    import time

    model, init, off, grads = make()
    real = step_validation.StepValidator.apply

    def slow_apply(self, current=None):
        time.sleep(0.3)
        real(self, current)

    backward(model, 0)
    monkeypatch.setattr(step_validation.StepValidator, "apply", slow_apply)
    t0 = time.perf_counter()
    off.step()
    elapsed = time.perf_counter() - t0
    blocked = off.stats()["step_blocked_s"]
    assert 0.3 <= blocked <= elapsed + 0.25, (blocked, elapsed)  # the end of backward adds its tail only


class _Failure(Exception):
    pass


def test_close_right_after_a_backward_that_raised_recovers_the_window_first(monkeypatch):
    """The recovery after a backward that raised runs at the next call. close() did not run
    it: it stopped the worker with chunks still queued, and a parameter split over two chunks
    was left half updated, its step not counted, without a word. close() now recovers first:
    the same state as zero_grad() (the recovery) and then close()."""
    from helpers import Boom, Gate, batches, build

    def run(recover_first):
        gate = Gate(monkeypatch)  # holds the CPU kernels: chunks still queued when close() comes
        model, opt = build("adamw")
        off = FullCPUOffloadOptimizer(opt, pinned_bytes=1 << 16, num_slots=8)
        model.l1.register_forward_hook(lambda m, i, o: Boom.apply(o))  # raises in backward when armed
        for s in range(2):
            x, extra = batches(s, 1)[0]
            model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
            off.step()
            off.zero_grad()
        x, extra = batches(2, 1)[0]
        loss = model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean()
        gate.opened.clear()
        Boom.armed = _Failure("backward failed")  # after head, l2 and extra sent their gradients
        with pytest.raises(_Failure):
            loss.backward()
        with pytest.warns(RuntimeWarning, match=r"raised; \d of 8 parameters had their update applied"):
            if recover_first:
                off.zero_grad()
            off.close()
        return {r.name: (r.step, r.param.detach().clone()) for r in records_of(off)}

    want, got = run(True), run(False)
    steps = [step for step, _ in want.values()]
    assert 3 in steps and 2 in steps  # the window's update counts for those whose chunks ran
    for name, (step, weight) in want.items():
        assert got[name][0] == step and torch.equal(got[name][1], weight), name


# ------------------------------- 9: failures after a chunk's kernel, and inside step()'s redo
@pytest.mark.parametrize("where", ["h2d copies", "second kernel call"])
def test_a_worker_failure_after_a_chunk_kernel_ran_says_which_parameters_it_left_half_done(monkeypatch, where):
    """A chunk's kernel updated masters and moments, then the chunk failed before its step was
    counted (its weight copies, or its next group's kernel call): those parameters match no
    whole step. That raised only the failure, and the recovery counted 0 of them stepped, their
    weights stale. Now the error names them and asks for the last checkpoint."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 3e-3}], lr=1e-2)
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    x = torch.randn(4, 8).to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    off.step()
    off.zero_grad()
    before = snapshot(off)
    if where == "h2d copies":
        def fail(*args, **kwargs):
            raise _Failure("copy failed")
        monkeypatch.setattr(off._transfer, "h2d_copies", fail)
    else:
        real, calls = chunk_runner.kernels.adamw_step, []

        def fail(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise _Failure("kernel failed")
            return real(*args, **kwargs)
        monkeypatch.setattr(chunk_runner.kernels, "adamw_step", fail)
    with pytest.raises(RuntimeError, match=r"only partly updated.*reload the last checkpoint") as info:
        model(x).float().pow(2).mean().backward()
        off.step()
    half_done = [rec.name for rec, (master, *_rest) in zip(records_of(off), before) if not torch.equal(rec.master, master)]
    assert half_done and all(repr(name) in str(info.value) for name in half_done)
    monkeypatch.undo()
    off.zero_grad()  # the optimizer stays usable
    model(x).float().pow(2).mean().backward()
    off.step()


@pytest.mark.parametrize("at", ["rollback", "redo"])
def test_a_failure_inside_the_redo_of_a_clipped_step_is_not_kept_as_the_step(monkeypatch, at):
    """An exception (not Ctrl-C, which waits for the redo) while step() rolled back a step that
    clipping changed closed the window keeping the speculative, unclipped update, counted, and
    the next step() found nothing to do. Now step() raises that the step did not complete,
    naming those parameters, from the failure. In the middle of the redo (a chunk failing
    before its kernel) the same holds: the error names what the failure left."""
    model, _, off, _ = make()
    backward(model, 0, factor=100.0)
    off.clip_grad_norm_(1e-3)
    real_rollback, real_run, redo_chunks = step_validation.rollback_adamw_pieces_, chunk_runner.ChunkRunner.run, []

    def rollback(*args, **kwargs):
        if at == "rollback":
            raise MemoryError("no memory")
        real_rollback(*args, **kwargs)
        redo_chunks.append("armed")

    def run(runner, chunk):  # the redo's second chunk fails before its kernel
        if redo_chunks:
            redo_chunks.append(chunk)
            if len(redo_chunks) == 3:
                raise MemoryError("no memory")
        real_run(runner, chunk)

    monkeypatch.setattr(step_validation, "rollback_adamw_pieces_", rollback)
    monkeypatch.setattr(chunk_runner.ChunkRunner, "run", run)
    with pytest.raises(RuntimeError, match=r"reload the last checkpoint") as info:
        off.step()
    causes, err = [], info.value
    while err is not None:
        causes.append(type(err))
        err = err.__cause__ or err.__context__
    assert MemoryError in causes
    named = [rec.name for rec in records_of(off) if repr(rec.name) in str(info.value)]
    assert named if at == "redo" else len(named) == len(records_of(off))


# ---------------------------- 10: a clip far below the speculative factor (rollback.py's bound)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.0, 1e-6])
def test_a_first_step_clipped_hard_is_redone_from_zero_moments(state_dtype, max_norm):
    """The first step speculates with factor 1; a clip far below it rolled the moments back
    from the rounded ones and left their rounding beside a v of about 0: with bf16 moments a
    clip to 0 moved the weights by 3.9e5 lr (1e-6: 2.2e4 lr). The moments before a first step
    are 0: the redo now equals the step made once with the final factor (a short window)."""
    def run(k):
        model, _, off, _ = make(state_dtype=state_dtype, grad_accum_steps=k)
        backward(model, 0, factor=100.0)
        off.clip_grad_norm_(max_norm)
        off.step()
        return records_of(off)

    for redone, once in zip(run(1), run(2)):
        assert redone.step == once.step == 1
        assert torch.equal(redone.exp_avg, once.exp_avg) and torch.equal(redone.exp_avg_sq, once.exp_avg_sq)
        assert float((redone.master - once.master).abs().max()) <= 2**-21 * float(once.master.abs().max())


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip_before", [True, False])
def test_a_loss_spike_clipped_after_unclipped_steps_stays_an_adamw_step(state_dtype, clip_before):
    """A gradient 10^4 times its history, clipped after steps that did not clip: its term
    dominated the moments the speculative step stored, so the rollback could not recover the
    old ones, and the redo moved weights by 1e6 lr (fp32 moments) and 4.6e6 lr (bf16) from
    torch's at a clip to 0, and by 12 lr (bf16) at a clip to the limit of the steps before.
    With that limit known (``clip_before``) the spike's chunks now wait for the factor (as
    torch: within 1e-3 lr, bf16 moments 0.02 lr); without it the redo starts from moments
    AdamW can reach and stays an AdamW step (within 2 lr)."""
    model, init, off, grads = make(state_dtype=state_dtype)
    ref = Reference(init)
    limit = 1.0
    for s in range(3):
        grads.clear()
        spike = s == 2
        backward(model, s, factor=1e4 if spike else 1.0)
        if clip_before or spike:
            norm = off.clip_grad_norm_(0.0 if spike and not clip_before else limit)
            assert (float(norm) > limit) == spike
        off.step()
        off.zero_grad()
        ref.step(grads, clip=(0.0 if spike and not clip_before else limit) if clip_before or spike else None)
    names = {id(p): n for n, p in model.named_parameters()}
    for rec in records_of(off):
        torch_master = ref.params[names[id(rec.param)]].detach().reshape(-1)
        error = float((rec.master - torch_master).abs().max()) / HP["lr"]
        # NOTE: bf16 moments round each step's moments (about 2**-8 lr a step against torch's)
        assert error <= ((1e-3 if state_dtype == torch.float32 else 0.02) if clip_before else 2.0), (rec.name, error)


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_first_steps_are_undone_in_batches_of_bounded_scratch_as_each_alone(moment_dtype, monkeypatch):
    """rollback_adamw_pieces_ undoes first steps (step 1) from the forward step's fp32 moments
    recomputed on zeros, in batches of at most _FIRST_STEP_BLOCK elements cut across and
    within pieces: each master equals the readable reference bit for bit, each moment is 0,
    and the later steps beside them are undone as alone."""
    from cpu_offload import kernels
    from cpu_offload._full import rollback
    from cpu_offload.reference import adamw_inverse_reference_, adamw_reference_

    monkeypatch.setattr(rollback, "_FIRST_STEP_BLOCK", 1024)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.7)
    g = torch.Generator().manual_seed(11)
    numels, steps = [5, 1000, 0, 2500, 300, 3], [1, 1, 1, 1, 4, 1]
    params = [torch.randn(n, generator=g) for n in numels]
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in numels]
    exp_avgs = [(torch.randn(n, generator=g) * 0.1).to(moment_dtype) for n in numels]
    exp_avg_sqs = [(torch.rand(n, generator=g) * 0.01).to(moment_dtype) for n in numels]
    want = [p.clone() for p in params]
    for i, (p, grad) in enumerate(zip(want, grads)):
        if steps[i] == 1:
            m1, v1 = torch.zeros(p.numel()), torch.zeros(p.numel())
            adamw_reference_(torch.zeros(p.numel()), grad, m1, v1, 1, **hp)
            adamw_inverse_reference_(p, grad, m1, v1, 1, **hp)
    later = [t.clone() for t in (params[4], exp_avgs[4], exp_avg_sqs[4])]
    rollback.rollback_adamw_pieces_([later[0]], [grads[4]], [later[1]], [later[2]], [4], **hp)
    want[4] = later[0]

    batches, real_step = [], kernels.adamw_step
    def counted(params, *args, **kwargs):
        batches.append([p.numel() for p in params])
        return real_step(params, *args, **kwargs)
    monkeypatch.setattr(kernels, "adamw_step", counted)
    rollback.rollback_adamw_pieces_(params, grads, exp_avgs, exp_avg_sqs, steps, **hp)

    assert batches == [[5, 1000], [1024], [1024], [452, 3]]
    for i, (p, w) in enumerate(zip(params, want)):
        assert torch.equal(p.view(torch.int32), w.view(torch.int32)), i
    for i in (0, 1, 2, 3, 5):
        assert not exp_avgs[i].any() and not exp_avg_sqs[i].any(), i
    assert torch.equal(exp_avgs[4], later[1]) and torch.equal(exp_avg_sqs[4], later[2])
