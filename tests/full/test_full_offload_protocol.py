# The backward/step protocol of full offload under the events real training
# loops meet: a backward that raises, reentrant checkpointing, skipped steps,
# short windows, work between backward and step(), weights changed outside the
# optimizer, zero_grad(set_to_none=False), parameters toggled or refused.
# Every outcome torch defines is checked against torch.optim.AdamW fed the same
# gradients (masters within fp32 rounding, step counts exact).

import contextlib
import copy
import gc
import io
import os
import re
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

from cpu_offload._full import optimizer as optimizer_module
from cpu_offload._full import pipeline as pipeline_module
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer, Phase
from helpers import (REPLAY_HP, SMALL, Boom, ReplayRun, is_interruptible_line, phase_of, records_of, sigint_at_line,
                     staging_rings_of)


class Net(nn.Module):
    def __init__(self, reentrant=False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = Boom.apply(torch.tanh(self.l1(x)))  # l2's and l3's gradients come before l1's
        h = torch.tanh(self.l2(h))
        if self.reentrant:  # the first gradients of backward arrive in a nested graph task
            return cp.checkpoint(self.l3, h, use_reentrant=True)
        return self.l3(h)


# gpu_state= for about half of Net's 5508 elements with fp32 AdamW state (12 B each): l1.bias,
# l2.bias and l3 on the device, the rest on the host.
HALF_STATE = 3100 * 12


class Harness(ReplayRun):
    """A wrapped Net (``reentrant``: its first gradients arrive in a nested graph task;
    ``freeze``: parameters frozen before wrapping) and a torch AdamW replay (its gradients
    clipped as ``clip_grad_norm_`` clips them when the optimizer has ``max_grad_norm``)."""

    def __init__(self, k=1, reentrant=False, freeze=(), seed=0, **opts):
        self.max_grad_norm = opts.get("max_grad_norm")
        torch.manual_seed(seed)
        model = Net(reentrant)
        for name in freeze:  # frozen parameters are not cast by the optimizer: bf16 like the inputs
            p = model.get_parameter(name)
            p.requires_grad_(False)
            p.data = p.data.to(torch.bfloat16)
        super().__init__(model, k=k, seed=seed, **opts)

    def backward(self, x=None):
        x = torch.randn(8, 16, generator=self.gen) if x is None else x
        self.model(x.to(torch.bfloat16)).float().pow(2).mean().backward()

    def train_normally(self, steps, k=1):
        for _ in range(steps):
            self.window = {}
            for _ in range(k):
                self.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.ref_window_step()

    def ref_window_step(self):
        """torch's step on the window's gradients, clipped like the optimizer's."""
        if self.max_grad_norm is None:
            return self.ref_step(self.window)
        for n, p in self.ref_params.items():
            p.grad = self.window[n].clone() if n in self.window else None
        torch.nn.utils.clip_grad_norm_([p for p in self.ref_params.values() if p.grad is not None], self.max_grad_norm)
        self.ref.step()


@contextlib.contextmanager
def applied_update_kept():
    """zero_grad() after a window's last backward warns that the update stays applied."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cpu_offload: (zero_grad|close)\\(\\) without step\\(\\)", RuntimeWarning)
        yield


@pytest.mark.parametrize("exc", [RuntimeError("simulated OOM"), KeyboardInterrupt()])
def test_exception_in_final_backward_keeps_state_consistent(exc):
    h = Harness()
    h.train_normally(2)
    h.window = {}
    Boom.armed = exc
    with pytest.raises(type(exc)):
        h.backward()
    with pytest.warns(RuntimeWarning, match="4 of 6 parameters had their update applied"):
        h.opt.zero_grad()  # the next call recovers (and warns)
    assert set(h.window) == {"l2.weight", "l2.bias", "l3.weight", "l3.bias"}
    # l2 and l3 were stepped during the failed backward: they count it; l1 got no gradient
    h.ref_step(h.window)
    assert phase_of(h.opt) is Phase.IDLE
    h.check()
    h.opt.state_dict()  # nothing stays locked
    h.train_normally(2)
    h.check()


def interrupt_call(monkeypatch, transfer, names, call, after):
    """Raise KeyboardInterrupt at the ``call``-th call (counted over ``names``, methods of
    ``transfer``), before the real call or right after it."""
    calls = [0]

    def interrupting(name):
        real = getattr(transfer, name)

        def interrupted(*args):
            calls[0] += 1
            if calls[0] == call and not after:
                raise KeyboardInterrupt
            out = real(*args)
            if calls[0] == call:
                raise KeyboardInterrupt
            return out
        monkeypatch.setattr(transfer, name, interrupted)
    for name in names:
        interrupting(name)


def check_recovers_exactly(monkeypatch, h, arrived=None):
    """After an interrupted backward: the recovery steps exactly the parameters whose
    gradients arrived (``arrived`` of them when given), as torch would, and training goes on."""
    with pytest.raises(KeyboardInterrupt):
        h.backward()
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match=f"{len(h.window)} of 6 parameters had their update applied"):
        h.opt.zero_grad()
    if arrived is not None:
        assert len(h.window) == arrived
    h.ref_step(h.window)
    h.check()
    h.train_normally(2)
    h.check()


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("call", [1, 2, 3, 4])
def test_interrupt_while_a_gradient_is_staged_is_finished_on_recovery(monkeypatch, call, after, max_grad_norm):
    """Ctrl-C inside a gradient hook, before or after the call that issues its norm's copy
    (1), its gradient's copy (2), or the next parameter's (3, 4): the recovery finishes the
    staging it interrupted, once."""
    h = Harness(max_grad_norm=max_grad_norm)
    h.train_normally(1)
    h.window = {}
    interrupt_call(monkeypatch, h.opt._pipeline.transfer, ("d2h_norm", "d2h_copy"), call, after)
    check_recovers_exactly(monkeypatch, h, arrived=(call + 1) // 2)


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("call", [1, 2, 3])
def test_interrupt_while_a_chunk_is_queued_is_finished_on_recovery(monkeypatch, call, after):
    """Ctrl-C at a chunk's completion marker, before or after it (the first two chunks close
    in hooks, the third at the end of backward): the recovery queues the chunk, once."""
    h = Harness()
    h.train_normally(1)
    h.window = {}
    interrupt_call(monkeypatch, h.opt._pipeline.transfer, ("d2h_marker",), call, after)
    check_recovers_exactly(monkeypatch, h)


def _is_counted_lock_call(frame, event) -> bool:
    """The entry of a Python function of ``threading`` (a Condition's ``__enter__``,
    ``__exit__``, ``notify_all``, ``wait``) called by the optimizer or the pipeline: where a
    SIGINT's handler runs between taking and releasing their lock."""
    caller = frame.f_back
    return (event == "call" and frame.f_code.co_filename == threading.__file__ and caller is not None
            and caller.f_code.co_filename in _TRACED)


_TRACED = (pipeline_module.__file__, optimizer_module.__file__)


def interrupted_at(h, k: int, call, start=None) -> bool:
    """SIGINT at the ``k``-th line of ``call()`` (``sigint_at_line``), which must then raise
    KeyboardInterrupt; False, the Harness closed, when ``call`` ran fewer lines."""
    hit, raised = sigint_at_line(k, call, start)
    if not hit:
        h.opt.close()
        return False
    assert isinstance(raised, KeyboardInterrupt), (k, raised)
    return True


def interrupted_backward(k: int, counted):
    """A trained Harness whose next (final) backward gets KeyboardInterrupt at the ``k``-th
    point ``counted(frame, event)`` accepts on this thread (lines of the hooks, their staging
    and queueing, the end of backward; or calls into ``threading``), as a Ctrl-C lands there;
    then recovered. Returns the Harness, the parameters whose step count rose, and the
    recovery's warnings, or None if the backward passed fewer than ``k`` such points."""
    h = Harness(timeout_s=10.0)  # NOTE: a hang fails in seconds, not in the default 600 s
    h.train_normally(1)
    h.window = {}
    before, seen = h.steps(), [0]

    def local(frame, event, arg):
        if counted(frame, event):
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt
        return local

    def trace(frame, event, arg):
        if frame.f_code.co_filename in _TRACED:
            return local(frame, event, arg)
        local(frame, event, arg)  # a call event into another module (threading)
        return None
    sys.settrace(trace)
    try:
        h.backward()
    except KeyboardInterrupt:
        pass
    else:
        return None
    finally:
        sys.settrace(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.opt.zero_grad()
    stepped = {n for n, s in h.steps().items() if s != before[n]}
    return h, stepped, [str(w.message) for w in caught]


@pytest.mark.parametrize("counted, at_least", [(is_interruptible_line, 100), (_is_counted_lock_call, 2)],
                         ids=["line", "lock_call"])
def test_an_interrupt_anywhere_in_a_backward_recovers_exactly(counted, at_least):
    """Ctrl-C at each line full offload runs in a final backward, and at the entry of each
    ``threading`` function it calls there: the recovery neither hangs nor raises, steps only
    parameters whose gradients arrived, says how many, each as torch AdamW fed that gradient,
    and training goes on exactly. (Before the fixes, a Ctrl-C between queueing a chunk and
    waking the worker left it asleep, and the recovery timed out; one just before the
    backward's window began made the next call raise ProtocolError; one on entering a
    Condition's ``__exit__`` left its lock held, and the worker and the recovery waited on it.)"""
    k = 0
    while (out := interrupted_backward(k + 1, counted)) is not None:
        k += 1
        h, stepped, said = out
        assert stepped <= set(h.window), k
        counts = [int(m.group(1)) for m in map(re.compile(r"(\d+) of 6 parameters had their update").search, said) if m]
        # NOTE: no warning when the backward died before its first gradient was taken, or
        # after its last one was (the window is then whole)
        assert counts == [len(stepped)] or (not counts and stepped in (set(), set(h.window))), (k, said)
        h.ref_step({n: g for n, g in h.window.items() if n in stepped})
        h.check()
        h.train_normally(1)
        h.check()
        h.opt.close()
        assert not h.opt._pipeline._thread.is_alive(), k  # the worker was left able to stop
    assert k > at_least  # every such point of one backward of this model was hit


def _died_in_backward(model, opt):
    """A backward of ``model`` that raises once the last four layers' gradients (8 of 16) arrived."""
    Boom.armed = RuntimeError("injected")
    with pytest.raises(RuntimeError, match="injected"):
        model[4:](Boom.apply(model[:4](torch.randn(4, 16).bfloat16()))).float().sum().backward()
    assert opt._proto.died_unrecovered()


def test_a_backward_that_raised_is_recovered_by_another_thread_only_before_a_forward_of_its_model():
    """The hook that recovers a backward that raised ran before any module's forward, on any
    thread: another thread's forward of its own module did this optimizer's recovery (and gave
    its warning); racing with this thread's zero_grad(), one of them raised ProtocolError.
    Another thread now recovers it only before the forward of a module holding its parameters."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **SMALL)
    other = nn.Linear(4, 4)
    _died_in_backward(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        elsewhere = threading.Thread(target=lambda: other(torch.randn(2, 4)))
        elsewhere.start()
        elsewhere.join()
        assert caught == [] and opt._proto.died_unrecovered()  # another model's forward there leaves it
        elsewhere = threading.Thread(target=lambda: model[6](torch.randn(4, 16).bfloat16()))
        elsewhere.start()
        elsewhere.join()
    assert len(caught) == 1 and re.search(r"backward pass 1 of 1 raised; 8 of 16 parameters", str(caught[0].message))
    assert phase_of(opt) is Phase.IDLE
    opt.close()


def test_a_functional_model_is_recovered_before_its_forward_reads_the_weights():
    """Weights in a ParameterList, read by a forward through modules that hold none of them:
    with recovery only before the forward of a module holding them, nothing recovered first,
    and the next backward found its saved weights rewritten (modified by an inplace
    operation). A forward on the optimizer's own thread recovers first, whatever the module."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    weights = nn.ParameterList([nn.Parameter(torch.randn(16, 16) * 0.1) for _ in range(8)])
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW(weights.parameters(), lr=1e-2), **SMALL)
    act = nn.GELU()

    def run(x, layers):
        for w in layers:
            x = act(x @ w)
        return x
    Boom.armed = RuntimeError("injected")
    with pytest.raises(RuntimeError, match="injected"):
        run(Boom.apply(run(torch.randn(4, 16).bfloat16(), weights[:4])), weights[4:]).float().sum().backward()
    with pytest.warns(RuntimeWarning, match=r"backward pass 1 of 1 raised; 4 of 8 parameters"):
        out = run(torch.randn(4, 16).bfloat16(), weights)
    out.float().sum().backward()
    opt.step()
    assert [r.step for r in records_of(opt)] == [1] * 4 + [2] * 4
    opt.close()


def test_a_forked_child_running_a_forward_leaves_the_parents_failed_backward_alone(tmp_path):
    """A child forked while a backward that raised was unrecovered ran the recovery before its
    first forward and waited, for good, for the parent's worker thread."""
    import subprocess
    import textwrap
    script = tmp_path / "fork_forward.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        import torch
        from cpu_offload import offload_optimizer
        torch.set_num_threads(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        opt = offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full")

        class Boom(torch.autograd.Function):
            forward = staticmethod(lambda ctx, x: x.view_as(x))
            backward = staticmethod(lambda ctx, g: (_ for _ in ()).throw(RuntimeError("injected")))
        try:
            model[1](Boom.apply(model[0](torch.randn(4, 16, dtype=torch.bfloat16)))).float().sum().backward()
        except RuntimeError:
            pass
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)
            model(torch.randn(4, 16, dtype=torch.bfloat16))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()  # the parent recovers, goes on
        opt.step()
        print(int(opt.state[model[1].weight]["step"]), int(opt.state[model[0].weight]["step"]))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "2", "1"], (out.stdout, out.stderr)


def test_two_threads_recovering_one_window_recover_it_once(monkeypatch):
    """Two calls of the optimizer that recover a backward that raised, on two threads (a
    zero_grad() beside a forward), could both find it unrecovered and both recover it: one of
    them then raised ProtocolError. The second now waits for the first and finds it done."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **SMALL)
    _died_in_backward(model, opt)
    checked, second, raised = type(opt._proto).died_unrecovered, [], []

    def zero_grad_beside():
        try:
            opt.zero_grad()
        except BaseException as e:  # NOTE: reported below, on the test's thread
            raised.append(e)

    def checked_while_another_thread_calls(proto):
        found = checked(proto)
        if found and not second and sys._getframe(1).f_code.co_name == "_settle":
            # the check that decides to recover: the other thread runs (or waits) before this one acts on it
            second.append(threading.Thread(target=zero_grad_beside))
            second[0].start()
            second[0].join(timeout=0.5)
        return found
    monkeypatch.setattr(type(opt._proto), "died_unrecovered", checked_while_another_thread_calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 16).bfloat16())
        second[0].join()
    assert raised == [], raised
    assert phase_of(opt) is Phase.IDLE
    assert sum("raised; 8 of 16 parameters" in str(w.message) for w in caught) == 1  # recovered once
    model(torch.randn(4, 16).bfloat16()).float().sum().backward()
    opt.step()
    opt.close()


@pytest.mark.parametrize("opts", [{}, {"max_grad_norm": 1e-3}], ids=["unclipped", "clipped"])
def test_after_a_ctrl_c_at_any_line_of_a_backward_the_next_window_trains_exactly(sigint_raises, opts):
    """A loop that goes on after a Ctrl-C in backward (as one that skips a failed batch): the
    next forward runs on recovered weights and no stale gradient, the next window trains as
    torch would. Before, the recovery ran at the next backward's first gradient and wrote
    weights that forward had saved (autograd raised that they were modified in place); a
    Ctrl-C in the callback that ends a backward left the next one raising that a gradient
    arrived twice; and a gradient left in ``.grad`` was added to the next window's. (A
    backward that died before its window began, in its first hook's first line, leaves what
    autograd wrote in ``.grad`` as torch does: the next backward adds to it, as torch's would.)"""
    k = 0
    while True:
        k += 1
        h = Harness(timeout_s=10.0, **opts)
        h.train_normally(1)
        h.window = {}
        before = h.steps()
        if not interrupted_at(h, k, h.backward):
            break
        dead_window, h.window = h.window, {}
        began = phase_of(h.opt) is not Phase.IDLE
        if phase_of(h.opt) is Phase.APPLIED:  # the window completed: the next backward would ask for step()
            h.opt.step()
            h.opt.zero_grad()
        at_forward = []
        check = h.model.register_forward_pre_hook(
            lambda m, args, h=h, seen=at_forward: seen.append((h.steps(), [p.grad for p in m.parameters()
                                                                           if p.grad is not None])))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h.backward()
        check.remove()
        steps, held = at_forward[0]
        stepped = {n for n in steps if steps[n] != before[n]}
        assert held == [] or not (began or stepped), k
        counts = [int(m.group(1)) for m in map(re.compile(r"(\d+) of 6 parameters had their update").search,
                                                [str(w.message) for w in caught]) if m]
        assert counts in ([len(stepped)], []), (k, counts)
        assert counts or stepped in (set(), set(dead_window)), k
        window, h.window = h.window, dead_window
        if stepped == set(dead_window) and not counts:
            h.ref_window_step()  # the whole window, clipped when the optimizer clips
        else:
            h.ref_step({n: g for n, g in dead_window.items() if n in stepped})
        h.window = window
        h.opt.step()
        h.opt.zero_grad()
        h.ref_window_step()
        h.check()
        h.opt.close()
    assert k > 500


@pytest.mark.parametrize("warm, opts", [(0, {}), (2, {}), (0, {"grad_copy": "host"}), (2, {"gpu_state": HALF_STATE})])
def test_a_ctrl_c_at_any_line_of_a_clipped_step_leaves_the_clipped_step(sigint_raises, warm, opts):
    """Every step clips: the first one speculates with factor 1 during backward and rolls back
    in step(), later ones wait for their coefficient. A Ctrl-C at any line of step() leaves
    every parameter stepped once with the clipped gradient once zero_grad() has run (the update
    was applied during backward, and zero_grad() says so), and training goes on exactly."""
    k = 0
    while True:
        k += 1
        h = Harness(timeout_s=10.0, max_grad_norm=1e-3, **opts)
        h.train_normally(warm)
        h.window = {}
        h.backward()
        if not interrupted_at(h, k, h.opt.step):
            break
        with applied_update_kept():
            h.opt.zero_grad()  # NOTE: completes a window that step() had not closed (device records step there)
        h.ref_window_step()
        h.check()
        h.train_normally(1)
        h.check()
        h.opt.close()
    assert k > 100


# The calls that close a window pending (after its last backward, before step()); state_dict()
# (tests/full/test_gpu_state.py) and load_state_dict() (below) refuse one.
PENDING_CALLS = {"zero_grad": lambda h: h.opt.zero_grad()}


def call_after_a_clipped_window(name, k=None, **opts):
    """A Harness that clips every step: a checkpoint after one step, a second step, a last
    backward, then the call ``name`` with SIGINT at its ``k``-th line (then the call once more,
    as after any Ctrl-C), step() (which closes the window, or finds it closed), and one more
    window. Returns the Harness, or None if the call ran fewer than ``k`` lines."""
    h = Harness(timeout_s=10.0, max_grad_norm=1e-3, **opts)
    h.train_normally(1)
    h.saved = copy.deepcopy(h.opt.state_dict())
    h.train_normally(1)
    h.window = {}
    h.backward()
    with applied_update_kept():
        if k is not None and not interrupted_at(h, k, lambda: PENDING_CALLS[name](h)):
            return None
        PENDING_CALLS[name](h)
    h.opt.step()
    h.opt.zero_grad()
    h.train_normally(1)
    return h


@pytest.mark.parametrize("opts", [{}, {"gpu_state": HALF_STATE}], ids=["host", "half_on_the_device"])
@pytest.mark.parametrize("name", list(PENDING_CALLS))
def test_a_ctrl_c_at_any_line_of_a_call_with_a_window_pending_changes_nothing(sigint_raises, name, opts):
    """Each call finishes before the interrupt is raised: made again, then training on, every
    master and step count equals the run without the interrupt, bit for bit. Before, a
    Ctrl-C in zero_grad() (which keeps the window's applied update) was delivered after the
    window had closed but before the phase moved on: the call made again closed the window a
    second time, which reset the factor the next window speculates with, so that window was
    stepped with factor 1 and redone (its masters 1e-4 off, not 1e-7)."""
    assert_every_interrupt_ends_alike(lambda k: call_after_a_clipped_window(name, k, **opts), more_than=100)


def load_after_a_clipped_window(k=None, **opts):
    """A Harness that clips every step: a checkpoint after one step, a second step, a last
    backward, then (unless ``k`` is None) load_state_dict() of the checkpoint with SIGINT at
    its ``k``-th line, and once more, refused; then step(), and one more window. Returns the
    Harness, or None if the load ran fewer than ``k`` lines."""
    h = Harness(timeout_s=10.0, max_grad_norm=1e-3, **opts)
    h.train_normally(1)
    saved = copy.deepcopy(h.opt.state_dict())
    h.train_normally(1)
    h.window = {}
    h.backward()
    if k is not None:
        with applied_update_kept():  # NOTE: copied: torch may adopt the loaded tensors
            if not interrupted_at(h, k, lambda: h.opt.load_state_dict(copy.deepcopy(saved))):
                return None
        with pytest.raises(RuntimeError, match="nothing was loaded and the window is as it was"):
            h.opt.load_state_dict(copy.deepcopy(saved))
    h.opt.step()
    h.opt.zero_grad()
    h.ref_window_step()
    h.train_normally(1)
    return h


@pytest.mark.parametrize("opts", [{}, {"gpu_state": HALF_STATE}], ids=["host", "half_on_the_device"])
def test_a_ctrl_c_at_any_line_of_a_load_with_a_window_pending_changes_nothing(sigint_raises, opts):
    """load_state_dict() between the window's last backward and step() is refused, and a
    Ctrl-C at any of its lines changes nothing either: step() then takes the window's step,
    and every master and step count equals the run without the load, bit for bit. Before,
    the load closed the window first (its step with the backward's hyper-parameters), so
    an interrupted or refused load left no window for step()."""
    assert_every_interrupt_ends_alike(lambda k: load_after_a_clipped_window(k, **opts), more_than=30)
    h = load_after_a_clipped_window(**opts)
    h.check()  # the run without the load is torch's
    h.opt.close()


def close_after_the_last_backward(k=None, **opts):
    """A Harness that clips every step (so the window after the first holds its chunks back),
    two steps, a last backward, then close() with SIGINT at its ``k``-th line and close() once
    more, as a user would. Returns the Harness, or None if close() ran fewer than ``k`` lines."""
    h = Harness(timeout_s=10.0, max_grad_norm=1e-3, **opts)
    h.train_normally(2)
    h.window = {}
    h.backward()
    with applied_update_kept():
        if k is not None and not interrupted_at(h, k, h.opt.close):
            return None
        h.opt.close()
    return h


@pytest.mark.parametrize("opts", [{}, {"gpu_state": HALF_STATE}], ids=["host", "half_on_the_device"])
def test_a_ctrl_c_at_any_line_of_close_after_the_last_backward_then_close_again_ends_alike(sigint_raises, opts):
    """close() without step() closes the window as step() does. A Ctrl-C on its first lines
    closed the optimizer all the same, the window left as it was: the held-back chunks and the
    device records never took the update, and close() again did nothing. Interrupted now, the
    optimizer stays open, and close() again finishes the window."""
    assert_every_interrupt_ends_alike(lambda k: close_after_the_last_backward(k, **opts), more_than=20)


def assert_every_interrupt_ends_alike(run, more_than: int) -> None:
    """``run(k)`` interrupts its call at line ``k`` (None: not at all) and returns the Harness
    after it, or None once the call ran fewer lines: at every line the step counts and masters
    equal the uninterrupted run's, bit for bit; the call ran more than ``more_than`` lines."""
    want = run(None)
    k = 0
    while (h := run(k + 1)) is not None:
        k += 1
        assert h.steps() == want.steps(), k
        for n, m in h.masters().items():
            assert torch.equal(m, want.masters()[n]), (k, n)
        h.opt.close()
    want.opt.close()
    assert k > more_than


def short_window_step(k=None, **opts):
    """A Harness of 3-pass windows that clip: one window, then a short one of 2 passes whose
    step() gets SIGINT at its ``k``-th line (then step() once more, as after any Ctrl-C), then
    one more window. Returns the Harness, or None if step() ran fewer than ``k`` lines."""
    h = Harness(k=3, timeout_s=10.0, max_grad_norm=1e-3, **opts)
    h.train_normally(1, k=3)
    h.window = {}
    for _ in range(2):
        h.backward()
    if k is not None and not interrupted_at(h, k, h.opt.step):
        return None
    h.opt.step()
    h.opt.zero_grad()
    h.train_normally(1, k=3)
    return h


@pytest.mark.parametrize("opts", [{}, {"gpu_state": HALF_STATE}], ids=["host", "half_on_the_device"])
def test_a_ctrl_c_at_any_line_of_a_short_window_step_takes_the_step(sigint_raises, opts):
    """step() after fewer passes than grad_accum_steps steps what was accumulated: a Ctrl-C at
    any of its lines is raised once that step is taken. Before, one while the window completed
    (its chunks queued or drained) aborted the window without a warning, so the parameters
    not yet stepped lost the step, and step() made again found nothing to do."""
    assert_every_interrupt_ends_alike(lambda k: short_window_step(k, **opts), more_than=50)


def end_of_last_backward(k=None, warm=1, **opts):
    """A Harness that clips every step: ``warm`` steps, then a window whose backward gets
    SIGINT at the ``k``-th line counted from the optimizer's end-of-backward signal (then
    step() as after any Ctrl-C), then one more window. Returns the Harness, or None if the
    end of that backward ran fewer than ``k`` lines."""
    h = Harness(timeout_s=10.0, max_grad_norm=1e-3, **opts)
    h.train_normally(warm)
    if k is None:
        h.backward()
    elif not interrupted_at(h, k, h.backward, start="_end_backward"):
        return None
    h.opt.step()
    h.opt.zero_grad()
    h.train_normally(1)
    return h


@pytest.mark.parametrize("warm, opts", [(0, {}), (1, {}), (1, {"gpu_state": HALF_STATE})])
def test_a_ctrl_c_at_any_line_of_the_end_of_the_last_backward_keeps_the_window(sigint_raises, warm, opts):
    """Once the last backward of a window has ended, a Ctrl-C is raised when the window is
    complete, and step() takes it. Before, one while the window's chunks were queued,
    landed or validated aborted the window without a warning: every gradient of the window
    was dropped (or, unclipped, those not yet stepped), and step() found nothing to do."""
    assert_every_interrupt_ends_alike(lambda k: end_of_last_backward(k, warm, **opts), more_than=50)


def one_step_after(model, opt) -> dict:
    """Wrap ``opt``, take one step on a fixed batch; the masters after it."""
    off = FullCPUOffloadOptimizer(opt, **SMALL)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    model(x.to(torch.bfloat16)).float().pow(2).mean().backward()
    off.step()
    masters = {id(r.param): r.master.clone() for r in records_of(off)}
    off.close()
    return masters


def test_a_ctrl_c_at_any_line_of_the_construction_leaves_the_model_as_it_was(sigint_raises):
    """Before, a Ctrl-C once the wrapper had claimed its parameters (about the last fifth of
    the construction) left them owned by a wrapper nobody holds, cast to bf16 and marked
    so: wrapping them again was refused. One on the casts' last line left them cast and
    unmarked: wrapping them again took the bf16 values for the fp32 masters."""
    def workers():
        gc.collect()
        return {t for t in threading.enumerate() if t.name == "cpu_offload-worker"}

    running = workers()  # NOTE: those of other tests' wrappers not yet closed
    torch.manual_seed(0)
    fresh = Net()
    want = list(one_step_after(fresh, torch.optim.AdamW(fresh.parameters(), **REPLAY_HP)).values())
    k = 0
    while True:
        k += 1
        torch.manual_seed(0)
        model = Net()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), **REPLAY_HP)
        built = []  # NOTE: holds a wrapper that was built: its finalizer must not run in the count
        gc.disable()  # NOTE: nor may an earlier wrapper's, which would take the interrupt
        try:
            hit, raised = sigint_at_line(k, lambda o=opt, b=built: b.append(FullCPUOffloadOptimizer(o, **SMALL)))
        finally:
            gc.enable()
        if not hit:
            built[0].close()
            break
        assert isinstance(raised, KeyboardInterrupt), (k, raised)
        for n, p in model.named_parameters():  # dtypes and values as before
            assert p.dtype == before[n].dtype and torch.equal(p.detach(), before[n]), (k, n)
        got = list(one_step_after(model, opt).values())  # NOTE: ``raised`` still holds the aborted wrapper
        assert all(torch.equal(a, b) for a, b in zip(got, want)), k
    assert workers() <= running  # every worker of an aborted construction stopped
    assert k > 500


def test_a_ctrl_c_in_torch_no_grad_exit_during_the_construction_leaves_grad_mode_on(monkeypatch):
    """A Ctrl-C landing in ``torch.no_grad``'s ``__exit__`` (the casts run under it), before it
    restores the mode, left gradients off after the aborted construction: the retry's backward
    then failed with "element 0 of tensors does not require grad"."""
    no_grad = torch.autograd.grad_mode.no_grad
    real_exit, exits = no_grad.__exit__, [0, 0]  # the construction's exits so far, the one to interrupt

    def interrupted_exit(self, *exc):
        exits[0] += 1
        if exits[0] == exits[1]:
            raise KeyboardInterrupt  # before the mode is restored
        return real_exit(self, *exc)
    while True:
        exits[:] = [0, exits[1] + 1]
        model = Net()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), **REPLAY_HP)
        monkeypatch.setattr(no_grad, "__exit__", interrupted_exit)
        try:
            built = FullCPUOffloadOptimizer(opt, **SMALL)
        except KeyboardInterrupt:
            built = None
        finally:
            monkeypatch.undo()
        if built is not None:
            built.close()
            break
        grad_on = torch.is_grad_enabled()
        torch.set_grad_enabled(True)  # NOTE: for the next round, and the next test, whatever this one left
        assert grad_on, exits
        assert all(p.dtype == before[n].dtype and torch.equal(p.detach(), before[n])
                   for n, p in model.named_parameters()), exits
    assert exits[1] > 2


def test_a_ctrl_c_while_the_construction_carries_a_stepped_optimizers_state_keeps_that_state(sigint_raises):
    """Wrapping an AdamW that has stepped carries its state over, then clears the torch
    optimizer's own copy. A Ctrl-C there (delivered where that block ends) undid the
    construction but not the clearing: the optimizer lost its moments and step counts, and
    wrapping it again restarted Adam from step 0, silently."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), **REPLAY_HP)
    for _ in range(2):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    kept = {p: {key: v.clone() for key, v in st.items()} for p, st in opt.state.items()}
    k = 0
    while True:
        k += 1
        built = []
        gc.disable()  # NOTE: as above: no finalizer may take the interrupt
        try:
            hit, raised = sigint_at_line(k, lambda b=built: b.append(FullCPUOffloadOptimizer(opt, **SMALL)),
                                         start="load_state_dict")
        finally:
            gc.enable()
        if not hit:
            break
        assert isinstance(raised, KeyboardInterrupt), (k, raised)
        assert list(opt.state) == list(kept), k
        for p, st in kept.items():
            assert all(torch.equal(opt.state[p][key], v) for key, v in st.items()), k
    assert k > 20
    built[0].close()


def test_exception_in_accumulation_window_discards_it():
    h = Harness(k=2)
    h.train_normally(1, k=2)
    h.window = {}
    h.backward()  # micro-batch 1 of 2 accumulates
    Boom.armed = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        h.backward()
    with pytest.warns(RuntimeWarning, match="backward pass 2 of 2 raised; .*discarded"):
        h.opt.step()  # nothing accumulated survives: a no-op, as torch after zero_grad
    h.ref_step({n: g for n, g in h.window.items() if n.startswith(("l2", "l3"))})  # stepped on what had accumulated
    h.check()
    h.train_normally(2, k=2)


def test_exception_in_first_micro_batch_discards_window():
    h = Harness(k=2)
    Boom.armed = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        h.backward()
    with pytest.warns(RuntimeWarning, match="backward pass 1 of 2 raised; the rest of the accumulation window"):
        state = h.opt.state_dict()
    assert all(e["step"].item() == 0 for e in state["state"].values())
    h.train_normally(2, k=2)
    h.check()


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("freeze", [(), ("l1.weight", "l1.bias", "l2.weight", "l2.bias")])
def test_reentrant_checkpoint_first_gradient_in_nested_task(k, freeze):
    h = Harness(k=k, reentrant=True, freeze=freeze)
    x = None
    for _ in range(3):
        h.window = {}
        for _ in range(k):
            x = torch.randn(8, 16, generator=h.gen, requires_grad=bool(freeze))  # LoRA-style: inputs need grad
            h.backward(x)
        h.opt.step()
        h.opt.zero_grad()
        h.ref_step(h.window)
    h.check()


@pytest.mark.parametrize("whose", ["optimizer", "model"])  # model.zero_grad() over all of them is the optimizer's
def test_backward_then_zero_grad_counts_the_applied_update(whose):
    h = Harness()
    h.train_normally(1)
    h.window = {}
    h.backward()
    with pytest.warns(RuntimeWarning, match="applied that update during backward"):
        (h.opt if whose == "optimizer" else h.model).zero_grad()  # "skip this batch": the update was applied already
    h.ref_step(h.window)  # so the consistent state is torch having taken the step
    h.opt.step()  # nothing since: a no-op
    h.train_normally(1)
    h.check()


def test_short_window_and_step_without_backward():
    h = Harness(k=3)
    h.opt.step()  # nothing since the last step: a no-op, as in torch
    h.check()
    h.window = {}
    h.backward()
    h.backward()
    h.opt.step()  # 2 of 3: steps on what was accumulated
    h.opt.zero_grad()
    h.ref_step(h.window)
    h.check()
    h.train_normally(2, k=3)
    h.check()


def test_forward_after_final_backward_sees_new_weights_and_second_backward_is_refused():
    h = Harness()
    for _ in range(6):
        h.window = {}
        h.backward()
        window = dict(h.window)
        for rec in records_of(h.opt):  # drained at the end of backward: the compute copy is the new one
            assert torch.equal(rec.param.detach(), rec.master.view(rec.shape).to(rec.param.dtype))
        with pytest.raises(RuntimeError, match=r"call step\(\) \(or zero_grad\(\)\) after every window"):
            h.backward()  # never torch's "modified by an inplace operation"
        h.opt.step()
        h.opt.zero_grad()
        h.ref_step(window)
    h.check()


def test_weights_loaded_after_wrapping_win_over_masters():
    h = Harness()
    h.train_normally(1)
    other = Net()
    h.model.load_state_dict(other.state_dict())  # a user's own restore, after wrapping
    for n, p in h.ref_params.items():
        with torch.no_grad():
            p.copy_(other.get_parameter(n).to(torch.bfloat16).float())  # the bf16 values are what is left
    h.train_normally(2)
    h.check()


def test_zero_grad_set_to_none_false_steps_like_torch():
    h = Harness()
    h.window = {}
    h.backward()
    h.opt.step()
    h.opt.zero_grad(set_to_none=False)  # torch keeps zero-filled gradients for every parameter
    h.ref_step(h.window)
    for _ in range(3):  # l3 alone gets a gradient; torch still steps l1/l2 with their zero gradients
        h.window = {}
        h.model.l3(torch.randn(8, 64, generator=h.gen).to(torch.bfloat16)).float().pow(2).mean().backward()
        h.opt.step()
        h.opt.zero_grad(set_to_none=False)
        zeros = {n: torch.zeros_like(p) for n, p in h.ref_params.items()}
        h.ref_step({**zeros, **h.window})
    h.check()
    assert records_of(h.opt)[0].step == 4


@pytest.mark.parametrize("gpu_state", [None, HALF_STATE], ids=["host", "half on the device"])
@pytest.mark.parametrize("k", [1, 2])
def test_step_with_no_backward_after_zero_grad_set_to_none_false_steps_the_zero_gradients_like_torch(k, gpu_state):
    # torch's step() steps every parameter holding a gradient, zero or not: weight decay,
    # the moments' decay and the step count move although no backward ran.
    h = Harness(k=k, gpu_state=gpu_state)
    h.train_normally(1, k=k)
    h.window = {}
    for _ in range(k):
        h.backward()
    h.opt.step()
    h.opt.zero_grad(set_to_none=False)  # every parameter now holds a zero gradient in torch
    h.ref_step(h.window)
    zeros = {n: torch.zeros_like(p) for n, p in h.ref_params.items()}
    for _ in range(2):
        h.opt.step()
        h.ref_step(zeros)
        h.check()
        assert h.opt.stats()["backward_passes"] == 0
    h.opt.zero_grad(set_to_none=True)  # now nothing holds a gradient: step() does nothing, as in torch
    before = h.masters()
    h.opt.step()
    assert all(torch.equal(before[n], m) for n, m in h.masters().items())
    h.train_normally(2, k=k)
    h.opt.zero_grad(set_to_none=False)
    h.window = {}
    for _ in range(k):
        h.backward()
    h.opt.step()
    h.ref_step(h.window)
    before = h.masters()
    h.opt.step()  # torch would step its kept gradients again (README): they are not kept, not zeros
    assert all(torch.equal(before[n], m) for n, m in h.masters().items())
    h.check()


def test_unfrozen_parameter_is_refused_clearly():
    """The refusal names the parameter, as the others do: after model.requires_grad_(True) on a
    model with many frozen parameters the user must know which to freeze again."""
    h = Harness(freeze=("l1.weight",))
    h.train_normally(1)
    h.model.l1.weight.requires_grad_(True)
    index = next(i for i, p in enumerate(h.opt.param_groups[0]["params"]) if p is h.model.l1.weight)
    with pytest.raises(RuntimeError, match=rf"param_groups\[0\]\[{index}\], frozen .* when the optimizer was "
                                           r"wrapped, now requires grad"):
        h.backward()
    h.model.l1.weight.requires_grad_(False)
    with pytest.warns(RuntimeWarning):
        h.train_normally(1)  # recovers: the failed pass is discarded
    h.check()


def test_sparse_gradient_is_refused_and_training_continues():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8, sparse=True)
    head = nn.Linear(8, 2)
    opt = FullCPUOffloadOptimizer(torch.optim.AdamW([*emb.parameters(), *head.parameters()]), **SMALL)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match="sparse.*dense gradients"):
        head(emb(ids)).float().sum().backward()
    with pytest.warns(RuntimeWarning, match="2 of 3 parameters had their update applied"):
        opt.step()
    assert emb.weight.grad is None


def test_wrapping_twice_is_refused():
    torch.manual_seed(0)
    model = Net()
    base = torch.optim.AdamW(model.parameters())
    first = FullCPUOffloadOptimizer(base, **SMALL)
    with pytest.raises(RuntimeError, match="already driven by a live FullCPUOffloadOptimizer"):
        FullCPUOffloadOptimizer(base, **SMALL)
    with pytest.raises(RuntimeError, match="already driven by another full-offload optimizer"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.l1.parameters()), **SMALL)
    first.close()
    with pytest.raises(RuntimeError, match=r"was cast from torch.float32 to torch.bfloat16 by a full-offload "
                                           r"optimizer.*model.to\(torch.float32\) and load a state_dict\(\) saved"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    del first
    model.float()  # the user accepts bf16-exact values as the new fp32 weights
    FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL).close()


def test_a_pickled_copy_of_a_model_in_training_is_refused_without_calling_its_optimizer_gone():
    """torch.save/torch.load of a model whose full-offload optimizer still trains keeps the
    cast mark, and wrapping the copy is refused; the message said the optimizer "was closed or
    dropped" while it was alive. It now names the optimizer of the model the copy came from."""
    torch.manual_seed(0)
    model = Net()
    live = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    with pytest.raises(RuntimeError, match=r"by a full-offload optimizer \(this model's, or that of the model it was "
                                           r"pickled from\)") as refused:
        FullCPUOffloadOptimizer(torch.optim.AdamW(restored.parameters()), **SMALL)
    assert "closed or dropped" not in str(refused.value)
    live.close()


def test_rewrapping_a_model_cast_from_fp16_is_refused():
    # fp16 -> bf16 keeps the item size but not the values: the masters of a second
    # wrapper would come from the bf16 compute copy.
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)).half()
    first = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    real = [r.master.clone() for r in records_of(first)]
    first.close()
    del first
    assert model[0].weight.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"was cast from torch.float16 to torch.bfloat16 by a full-offload optimizer.*"
                                           r"model.to\(torch.float16\)"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    model.float()  # not the dtype it was cast from: still the bf16 values
    with pytest.raises(RuntimeError, match=r"cast from torch.float16 to torch.bfloat16 .* is torch.float32 now"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    model.double()  # float64 parameters are refused whatever they held
    with pytest.raises(TypeError, match=r"is float64: full offload steps fp32 masters"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    model.half()  # back to its own dtype: the user accepts the values it holds
    held = [p.detach().float().reshape(-1) for p in model.parameters()]
    again = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    assert all(torch.equal(r.master, h) for r, h in zip(records_of(again), held))
    assert not all(torch.equal(r.master, m) for r, m in zip(records_of(again), real))  # bf16 rounding lost bits
    again.close()


def test_rewrapping_a_parameter_cast_up_to_fp32_is_accepted():
    # A bf16 parameter with an fp32 compute copy holds its master exactly.
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = nn.Linear(16, 8).to(torch.bfloat16)
    first = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), compute_dtype=torch.float32, **SMALL)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    first.step()
    masters = [r.master.clone() for r in records_of(first)]
    first.close()
    del first
    again = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), compute_dtype=torch.float32, **SMALL)
    assert all(torch.equal(r.master, m) for r, m in zip(records_of(again), masters))
    again.close()


def test_worker_error_surfaces_once_then_training_continues():
    h = Harness()
    h.train_normally(1)
    h.opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] is nan"):
        h.backward()
    h.opt.param_groups[0]["lr"] = REPLAY_HP["lr"]
    with pytest.warns(RuntimeWarning, match="0 of 6 parameters"):
        h.opt.zero_grad()
    h.train_normally(2)
    h.check()


def test_injected_kernel_failure_surfaces_once(monkeypatch):
    import cpu_offload._full.chunk_runner as runner
    h = Harness()
    real = runner.kernels.adamw_step
    monkeypatch.setattr(runner.kernels, "adamw_step", lambda *a, **k: (_ for _ in ()).throw(OSError("disk on fire")))
    with pytest.raises(RuntimeError, match=r"worker failed on chunk \d+ .*OSError: disk on fire"):
        h.backward()
    monkeypatch.setattr(runner.kernels, "adamw_step", real)
    with pytest.warns(RuntimeWarning, match="0 of 6 parameters had their update applied") as record:
        h.opt.step()  # the failed window is closed; nothing was stepped
    assert record[0].filename == __file__  # the warning points at the caller's line
    h.check()
    h.train_normally(2)
    h.check()


def test_close_frees_rings_and_failed_construction_leaves_model_unchanged(monkeypatch):
    import gc
    import cpu_offload._full.optimizer as fo

    def ring_tensors(ptrs):
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on every object touches deprecated torch names
            warnings.simplefilter("ignore", FutureWarning)
            # NOTE: plain tensors only: torch.compile's caches (other tests) hold fake ones, without data
            return [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)
                    and t.device.type == "cpu" and t.untyped_storage().data_ptr() in ptrs]
    h = Harness()
    h.train_normally(1)
    ptrs = {ring.slots[0].buf.untyped_storage().data_ptr() for ring in staging_rings_of(h.opt)}
    assert ring_tensors(ptrs)  # the rings are alive while the optimizer is open
    h.opt.close()
    assert not ring_tensors(ptrs)  # close() dropped every view of both rings

    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def fail(*a, **k):
        raise RuntimeError("injected pipeline failure")
    monkeypatch.setattr(fo, "Pipeline", fail)
    with pytest.raises(RuntimeError, match="injected pipeline failure"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n]), n
    monkeypatch.undo()
    FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL).close()  # not owned, not cast


def test_optimizer_used_after_fork_fails_at_once():
    import multiprocessing as mp
    h = Harness()
    h.train_normally(1)
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            h.opt.step()
            q.put("no error")
        except RuntimeError as e:
            q.put(str(e))
    proc = ctx.Process(target=child)
    proc.start()
    msg = q.get(timeout=60)
    proc.join(60)
    assert "after fork()" in msg and proc.exitcode == 0


@pytest.mark.parametrize("how", ["exit", "gc", "close"])
def test_a_child_forked_with_a_window_pending_exits_at_once(tmp_path, how):
    """The wrapper's finalizer, run in a forked child (at its exit, or when the child drops
    the wrapper), waited for queued chunks on a worker thread the child does not have, for
    the whole timeout_s, and so did close() there. The finalizer leaves the parent's pipeline
    alone there, and close() raises at once, as every other call does in a child."""
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "fork_child.py"
    script.write_text(textwrap.dedent(f"""
        import gc, os, sys, time
        import torch
        from cpu_offload import offload_optimizer
        torch.set_num_threads(1)
        model = torch.nn.Linear(64, 4)
        opt = offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full", grad_accum_steps=2,
                                timeout_s=60)
        model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()  # 1 of 2: a window pending
        pid = os.fork()
        if pid == 0:
            if {how!r} == "gc":
                del opt
                gc.collect()
            if {how!r} == "close":
                try:
                    opt.close()
                except RuntimeError as e:
                    sys.exit(0 if "after fork()" in str(e) else 3)
                sys.exit(4)
            sys.exit(0)
        start = time.monotonic()
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), round(time.monotonic() - start, 1))
        model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()  # the parent goes on
        opt.step()
        print(int(opt.state[model.weight]["step"]))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    code, seconds, steps = out.stdout.split()
    assert code == "0" and float(seconds) < 20 and steps == "1", out.stdout


def test_a_wrapper_finalized_by_the_garbage_collector_while_another_is_built_does_not_deadlock(monkeypatch):
    """The collector can run inside a construction (claim() allocates a weak reference per
    parameter) and finalize an unreachable wrapper there, whose release takes the ownership
    lock that claim() holds: the test suite hung in it. The lock is reentrant."""
    import gc
    import threading
    import types
    import weakref
    from cpu_offload._full import ownership

    def build_while_another_is_finalized(done):
        torch.manual_seed(0)
        old = FullCPUOffloadOptimizer(torch.optim.AdamW(Net().parameters()), **SMALL)
        old.cycle = old  # unreachable once dropped, until the collector runs
        del old
        collected = []

        def ref_that_collects(obj, *args):
            if not collected:
                collected.append(gc.collect())  # NOTE: inside claim(), with its lock held
            return weakref.ref(obj, *args)
        # NOTE: the module's own name only, so only ownership.py's weak references collect
        monkeypatch.setattr(ownership, "weakref", types.SimpleNamespace(ref=ref_that_collects))
        new = FullCPUOffloadOptimizer(torch.optim.AdamW(Net().parameters()), **SMALL)
        done.append((collected, new))

    gc.disable()
    try:
        done: list = []
        thread = threading.Thread(target=build_while_another_is_finalized, args=(done,), daemon=True)
        thread.start()
        thread.join(30)
    finally:
        gc.enable()
    assert not thread.is_alive(), "deadlocked"
    (collected, new), = done
    assert collected and collected[0] > 0  # the old wrapper was collected inside claim()
    new.close()


def test_ddp_model_is_refused(gloo_group):
    model = nn.parallel.DistributedDataParallel(Net())
    with pytest.raises(RuntimeError, match="DistributedDataParallel model"):
        FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), **SMALL)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_proxy_with_a_copied_dict_drives_the_same_optimizer():
    """Lightning's LightningOptimizer: a class deriving from the wrapper's, whose instance
    holds a shallow copy of the wrapper's __dict__; calls on it must drive the real state."""
    h = Harness(k=2)
    h.train_normally(1, k=2)

    class Proxy:
        pass
    proxy = type("ProxyFull", (Proxy, type(h.opt)), {}).__new__(type("ProxyFull", (Proxy, type(h.opt)), {}))
    proxy.__dict__ = dict(h.opt.__dict__)
    for _ in range(3):
        h.window = {}
        h.backward()
        h.backward()
        proxy.step()
        proxy.zero_grad()
        h.ref_step(h.window)
    del proxy
    import gc
    gc.collect()  # a dropped proxy closes nothing
    h.train_normally(1, k=2)
    h.check()


def test_gradients_that_bypassed_the_hooks_are_reported():
    h = Harness()
    h.train_normally(1)
    h.model.l2.bias.grad = torch.ones_like(h.model.l2.bias)  # as FSDP2 leaves them after an unreset failure
    with pytest.raises(RuntimeError, match=r"reached param.grad without passing through full offload's hooks"):
        h.opt.step()
    h.opt.zero_grad()
    h.train_normally(1)
    h.check()


def test_model_zero_grad_in_the_middle_of_a_window_discards_it_as_torch_does():
    # HF Trainer clears gradients with model.zero_grad() when train() starts: after a run stopped
    # in the middle of a window (Ctrl-C in a notebook), the next run must not step the stale
    # micro-batches, as torch does not.
    h = Harness(k=3)
    h.train_normally(1, k=3)
    h.backward()
    h.backward()  # 2 of 3: the loop stops here
    h.model.zero_grad()
    assert phase_of(h.opt) is Phase.IDLE
    h.train_normally(2, k=3)  # whole windows, stepped exactly
    h.check()
    h.window = {}
    h.model.l1.zero_grad()  # part of the parameters between windows: nothing is held, nothing to do
    h.backward()
    with pytest.raises(ValueError, match=r"model\.zero_grad\(\) over 2 of the 6 parameters of a full-offload "
                                         r"optimizer in the middle of an accumulation window"):
        h.model.l2.zero_grad()  # a window cannot drop part of itself
    h.model.zero_grad(set_to_none=False)  # all of them, as the optimizer's zero_grad(set_to_none=False)
    h.window = {}
    for _ in range(3):
        h.backward()
    h.opt.step()
    h.ref_step(h.window)
    h.check()



@pytest.mark.parametrize("gpu_state", [None, HALF_STATE])
def test_module_zero_grad_between_windows_drops_the_zeroed_gradients_it_holds(gpu_state):
    # After the optimizer's zero_grad(set_to_none=False) every parameter holds a zero gradient,
    # which torch's step() steps; a module's zero_grad() (set_to_none=True) then drops its own,
    # and torch's step() skips them. It used to leave them held: stepped once more, silently.
    h = Harness(gpu_state=gpu_state)
    h.train_normally(1)
    names = set(h.init)
    h.window = {}
    h.backward()
    h.opt.step()
    h.ref_step(h.window)
    h.opt.zero_grad(set_to_none=False)
    h.model.l3.zero_grad()  # l3's gradients are dropped
    h.model.l2.zero_grad(set_to_none=False)  # l2's stay held, as zeros
    h.window = {}
    h.opt.step()  # no backward: the parameters still holding a zero gradient are stepped
    h.ref_step({}, zero_held={n for n in names if not n.startswith("l3.")})
    h.check()
    assert h.steps()["l3.weight"] == 2 and h.steps()["l1.weight"] == 3
    h.opt.zero_grad(set_to_none=False)
    h.model.l3.zero_grad()
    h.window = {}
    h.backward()  # a window that reaches every parameter holds them all again
    h.opt.step()
    h.ref_step(h.window)
    h.check()
