# Random training loops against full offload. Each seed draws one program of windows that
# mixes what real loops do: accumulation windows of varying and short length (with and
# without host accumulators), windows dropped by zero_grad() without step(), step() with no
# backward, clipping by call (the optimizer's or torch's function; any norm type, also in
# the middle of a window) or by option,
# NaN losses, gradient factors announced before a pass or given after the last, zero_grad
# with and without set_to_none, parameters that get no gradient, learning-rate, weight-decay
# and betas changes, moments written through opt.state, weights edited outside the
# optimizer (also between two passes of a window), passes whose backward raises, refused
# checkpoints in the middle of a window, state round trips, and resumes into a new model and
# wrapper from the run's checkpoint or from the plain torch optimizer's. The program runs on configurations that the numerics
# contract says step bit for bit alike (CONFIGS), compared after every window, and each run
# is checked against the torch optimizer emulated literally (its .grad tensors,
# clip_grad_norm_, zero_grad) on the gradients the run computed.

import contextlib
import functools
import math
import random
import warnings
from dataclasses import dataclass, field
from unittest import mock
from typing import Optional

import pytest
import torch
import torch.nn as nn

import cpu_offload
from cpu_offload import SignSGD
from cpu_offload._full import device_state
from helpers import (HALF_STATE, SMALL, Boom, Net, assert_bit_equal, clone_tree, normwise, records_of, sigint_at_line,
                     watch_rollbacks, window_scale_of)

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
WINDOWS = 24


@dataclass
class Window:
    k: int  # opt.grad_accum_steps for this window
    passes: int  # backward passes run (< k: a short window; 0: step() with nothing)
    scales: list  # loss factor per pass (NaN: the step is skipped)
    extra: list  # per pass: whether Net.extra gets a gradient
    drop: bool = False  # zero_grad() without step()
    announce: Optional[tuple] = None  # (pass, factor): scale_grads_ before that pass's backward
    late: Optional[float] = None  # scale_grads_ after the last backward
    clip: Optional[float] = None  # clip_grad_norm_(clip, norm_type) before step()
    norm_type: float = 2.0
    mid_clip: Optional[tuple] = None  # (pass, max_norm): clip_grad_norm_ after that pass, not the last
    mid_lr: Optional[tuple] = None  # (group, new lr) after the first pass, before the last one starts
    peek: bool = False  # state_dict() in the middle of the window: the last step's state
    round_trip: bool = False  # load_state_dict(state_dict()) before the window, as accelerate's set-up
    set_to_none: bool = True
    lr: Optional[tuple] = None  # (group, new lr) before the window
    weight_decay: Optional[tuple] = None  # (group, new weight decay) before the window
    edit: bool = False  # l2.weight halved outside the optimizer before the window
    mid_edit: int = -1  # l2.bias halved after this pass, not the last (-1: none)
    betas: Optional[tuple] = None  # (group, new betas) before the window (AdamW)
    moment: Optional[float] = None  # opt.state[l1.weight]["exp_avg"] = it times this, before the window
    resume: bool = False  # checkpoint after the window; a new model and wrapper load it
    migrate: bool = False  # ... the plain torch optimizer's checkpoint, the model its fp32 weights
    fail: int = -1  # the pass whose backward raises after the head's gradients (-1: none)
    interrupt: Optional[tuple] = None  # (call, k): SIGINT at the call's k-th line, then the call again


@dataclass
class Program:
    seed: int
    algorithm: str  # "adamw" or "sign_sgd"
    max_grad_norm: Optional[float]
    largest: int  # the largest window, the wrapper's grad_accum_steps (1: no host accumulators)
    windows: list = field(default_factory=list)


def draw(seed: int, algorithm: str, failures: bool = True, migrations: bool = True) -> Program:
    rng = random.Random(seed)
    edits = random.Random(f"{seed} mid_edit")  # NOTE: its own stream: the other draws stay as they were
    clipping = rng.choice(["none", "call", "option"])
    program = Program(seed, algorithm, max_grad_norm=0.05 if clipping == "option" else None,
                      largest=1 if seed % 3 == 2 else 3)
    for _ in range(WINDOWS):
        k = rng.randint(1, program.largest)
        passes = k if rng.random() < 0.75 else rng.randint(0, k - 1) if k > 1 else rng.choice([0, 1])
        w = Window(k, passes, scales=[10 ** rng.uniform(-1, 1) for _ in range(passes)],
                   extra=[rng.random() < 0.4 for _ in range(passes)])
        if passes and rng.random() < 0.06:
            w.scales[rng.randrange(passes)] = math.nan
        w.drop = passes > 0 and rng.random() < 0.1
        if passes and rng.random() < 0.2:
            w.announce = (rng.randrange(passes), 2 ** rng.uniform(-2, 2))
        if passes and not w.drop and rng.random() < 0.2:
            w.late = 2 ** rng.uniform(-2, 2)
        if clipping == "call" and passes and not w.drop and rng.random() < 0.7:
            w.clip = rng.choice([0.02, 0.05, 0.2, 1e3])
            w.norm_type = rng.choice([2.0, 2.0, 1.0, math.inf])
        if clipping == "call" and passes > 1 and rng.random() < 0.3:
            w.mid_clip = (rng.randrange(passes - 1), rng.choice([0.02, 0.2]))
        if passes > 1 and rng.random() < 0.2:
            w.mid_lr = (rng.randrange(2), HP["lr"] * 2 ** rng.uniform(-2, 1))
        w.peek = passes > 1 and rng.random() < 0.1
        w.round_trip = rng.random() < 0.1
        w.set_to_none = rng.random() < 0.6
        if rng.random() < 0.2:
            w.lr = (rng.randrange(2), HP["lr"] * 2 ** rng.uniform(-2, 1))
        if rng.random() < 0.1:
            w.weight_decay = (rng.randrange(2), rng.choice([0.0, 0.01, 0.1]))
        w.edit = rng.random() < 0.08
        if passes > 1 and edits.random() < 0.15:
            w.mid_edit = edits.randrange(passes - 1)
        if algorithm == "adamw" and rng.random() < 0.08:
            w.betas = (rng.randrange(2), rng.choice([(0.9, 0.95), (0.8, 0.99), (0.95, 0.999)]))
        if algorithm == "adamw" and rng.random() < 0.08:
            w.moment = rng.choice([0.0, 0.5, -1.0])
        w.resume = rng.random() < 0.12
        w.set_to_none = w.set_to_none or w.resume  # then a resume loses no .grad torch would keep
        w.migrate = migrations and w.resume and rng.random() < 0.4
        if failures and passes and rng.random() < 0.06:
            w.fail = rng.randrange(passes)
        if rng.random() < 0.25:
            calls = ["zero_grad", "round_trip"] + (["step"] if passes and not w.drop else []) + (
                ["state_dict", "load"] if w.resume else [])
            w.interrupt = (rng.choice(calls), rng.randint(1, 300))
        program.windows.append(w)
    return program


def groups_of(model):
    p = dict(model.named_parameters())
    return [{"params": [p["l1.weight"], p["l1.bias"], p["head.weight"], p["head.bias"], p["unused"], p["frozen"]],
             "weight_decay": 0.1},
            {"params": [p["l2.weight"], p["l2.bias"], p["extra"]], "lr": HP["lr"] * 0.3, "weight_decay": 0.02}]


def optimizer(groups, algorithm):
    return torch.optim.AdamW(groups, **HP) if algorithm == "adamw" else SignSGD(groups, lr=HP["lr"] * 0.1)


def batch(seed, window, m):
    return torch.randn(4, 24, generator=torch.Generator().manual_seed(seed * 100003 + window * 31 + m))


class TorchEmulation:
    """The torch optimizer on fp32 copies of the weights, driven as a torch loop drives it: its
    ``.grad`` tensors accumulate the run's gradients, then scale, clip, step and zero_grad,
    except that a step with a NaN or Inf gradient is skipped (the wrapper's skip_nonfinite)."""

    def __init__(self, model, algorithm):
        self.params = {n: nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                       for n, p in model.named_parameters()}
        by_id = {id(p): n for n, p in model.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [self.params[by_id[id(p)]] for p in g["params"]]}
                  for g in groups_of(model)]
        self.opt = optimizer(groups, algorithm)

    def add(self, grads):
        for n, g in grads.items():
            p = self.params[n]
            p.grad = g.clone() if p.grad is None else p.grad + g

    def with_grad(self):
        return [p for p in self.params.values() if p.grad is not None]

    def scale(self, factor):
        for p in self.with_grad():
            p.grad.mul_(factor)

    def clip(self, max_norm, norm_type=2.0, factor=1.0):
        """clip_grad_norm_ on the gradients times ``factor`` (announced, applied at the end)."""
        params = self.with_grad()
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type) * factor
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def step(self):
        if all(torch.isfinite(p.grad).all() for p in self.with_grad()):
            self.opt.step()

    def zero_grad(self, set_to_none):
        self.opt.zero_grad(set_to_none=set_to_none)

    def take(self, state, names) -> None:
        """Continue from full offload's state (``state_dict()["state"]``, ``names``: index ->
        name): its masters, moments and step counts; no ``.grad``."""
        self.opt.zero_grad(set_to_none=True)
        for j, entry in state.items():
            p = self.params[names[j]]
            p.data.copy_(entry["master"].view(p.shape))
            self.opt.state.pop(p, None)
            if int(entry.get("step", 0)) and "exp_avg" in entry:
                self.opt.state[p] = {"step": torch.tensor(float(entry["step"])),
                                     "exp_avg": entry["exp_avg"].float().clone().view(p.shape),
                                     "exp_avg_sq": entry["exp_avg_sq"].float().clone().view(p.shape)}

    def resumed(self):
        """A resume starts with no ``.grad``, as a fresh model has none."""
        self.opt.zero_grad(set_to_none=True)


class Run:
    """One program on one configuration: ``options(model, resumes)`` gives the wrapper's
    options for the ``resumes``-th model (0 for the first); ``shard(model)``, when given,
    shards each new model with FSDP2 (then the check against torch is left to the caller)."""

    def __init__(self, program: Program, options, *, state_dtype=torch.float32, resumes=True, shard=None,
                 interrupts=False):
        self.program, self.options, self.state_dtype = program, options, state_dtype
        self.resuming, self.shard, self.interrupts = resumes, shard or (lambda model: model), interrupts
        self.resumes = 0
        self.model = self._new_model()
        self.torch = (TorchEmulation(self.model, program.algorithm)
                      if state_dtype == torch.float32 and shard is None else None)
        self.rollback_error = 0.0
        self.splits_agree = True  # no rollback nor failed pass yet: any split steps alike
        self.migrated = False  # resumed from torch's checkpoint: a run without resumes differs
        self.moved = False  # some state was on the device after a window
        self._wrap()

    def _wrap(self, state=None, w=None):
        self.passes = {}  # name -> [gradient of each backward pass in the window]
        for n, p in self.model.named_parameters():
            if p.requires_grad:  # registered first: runs before the wrapper's hook
                p.register_post_accumulate_grad_hook(
                    lambda p, n=n: self.passes.setdefault(n, []).append(p.grad.detach().float().clone()))
        extra = dict(state_dtype=self.state_dtype) if self.program.algorithm == "adamw" else {}
        self.opt = cpu_offload.offload_optimizer(
            optimizer(groups_of(self.model), self.program.algorithm), offload="full", grad_accum_steps=self.program.largest,
            max_grad_norm=self.program.max_grad_norm, **extra, **self.options(self.model, self.resumes))
        if state is not None:
            self._call(w, "load", lambda: self.opt.load_state_dict(state))
        watch_rollbacks(self.opt, self._rolled_back)

    def _rolled_back(self, stepped) -> None:
        """The documented error of a rollback and redo: about 2**-24 * r**2 relative on the
        second moment, r the factor the step speculated with over the final one (clipping.md);
        the tolerance against torch grows by four times that, summed over the rollbacks."""
        if not stepped:
            return
        self.splits_agree = False
        final = window_scale_of(self.opt)
        r = max([1.0] + [piece.hparams["grad_scale"] / final for piece in stepped if final > 0])
        self.rollback_error += 2.0**-22 * r * r

    def _set(self, change, key):
        if change is not None:
            self.opt.param_groups[change[0]][key] = change[1]
            if self.torch is not None:
                self.torch.opt.param_groups[change[0]][key] = change[1]

    def window(self, i: int, w: Window) -> dict:
        opt, model, ref = self.opt, self.model, self.torch
        self._set(w.lr, "lr")
        self._set(w.weight_decay, "weight_decay")
        self._set(w.betas, "betas")
        if w.moment is not None:
            self._write_moment(w.moment)
        if w.round_trip:
            self._call(w, "round_trip", lambda: opt.load_state_dict(opt.state_dict()))
        if w.edit:
            opt.wait_for_weights()
            with torch.no_grad():
                model.l2.weight.mul_(0.5)
            if ref is not None:
                ref.params["l2.weight"].data.copy_(model.l2.weight.detach().float())
        opt.grad_accum_steps = w.k
        factor = 1.0  # NOTE: a factor announced in a window scales its whole sum, applied at its end
        for m in range(w.passes):
            if w.announce is not None and w.announce[0] == m:
                opt.scale_grads_(w.announce[1])
                factor *= w.announce[1]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.mixed()):
                loss = model(batch(self.program.seed, i, m).to(torch.bfloat16), use_extra=w.extra[m]).float().pow(2).mean()
            if m == w.fail:
                return self._failed_pass(i, w, loss * w.scales[m])
            (loss * w.scales[m]).backward()
            if ref is not None:
                ref.add({n: g[-1] for n, g in self.passes.items()})
                self.passes.clear()
            if w.mid_edit == m:  # the step updates the edited weight, as torch's
                with torch.no_grad():
                    model.l2.bias.mul_(0.5)
                if ref is not None:
                    ref.params["l2.bias"].data.copy_(model.l2.bias.detach().float())
            if w.mid_clip is not None and w.mid_clip[0] == m:
                got = float(opt.clip_grad_norm_(w.mid_clip[1]))
                if ref is not None:
                    check_norm(got, ref.clip(w.mid_clip[1], factor=factor), (i, m))
            if m == 0 and w.passes > 1:
                self._set(w.mid_lr, "lr")
                if w.peek:  # the state of the last step, as torch's; nothing changes
                    opt.state_dict()  # NOTE: the masters take an edit made before it (mid_edit)
                    before = self.state_now()
                    saved = opt.state_dict()["state"]
                    assert_bit_equal(self.state_now(), before, f"window {i}: state_dict() in the window")
                    params = [p for g in opt.param_groups for p in g["params"]]
                    for index, entry in saved.items():
                        live = gathered(dict(opt.state[params[index]].items()))
                        assert_bit_equal(gathered({k: entry[k] for k in live}), live, f"window {i}: state_dict()")
        norm = None
        if ref is not None:
            # NOTE: max_grad_norm clips when the window's last backward ends: before a factor
            # given after it; a short window ends at step(), after that factor.
            complete, option = w.passes == w.k, self.program.max_grad_norm
            ref.scale(factor)
            if complete and option is not None:
                ref.clip(option)
            if w.late is not None:
                ref.scale(w.late)
            if not complete and not w.drop and option is not None:
                ref.clip(option)
            if w.clip is not None:
                norm = ref.clip(w.clip, w.norm_type)
            if complete or not w.drop:
                ref.step()
            ref.zero_grad(w.set_to_none)
        if w.late is not None:
            opt.scale_grads_(w.late)
        # NOTE: in odd windows through torch's function, as the frameworks clip (torch_clipping.py)
        clip = opt.clip_grad_norm_ if i % 2 == 0 else functools.partial(torch.nn.utils.clip_grad_norm_,
                                                                         self.model.parameters())
        got_norm = float(clip(w.clip, w.norm_type)) if w.clip is not None else None
        if not w.drop:
            self._call(w, "step", opt.step)
        self._call(w, "zero_grad", lambda: opt.zero_grad(set_to_none=w.set_to_none))
        if norm is not None:
            check_norm(got_norm, norm, i)
        state = self.state()
        self.moved = self.moved or any(r.on_device for r in records_of(opt))
        if w.resume and self.resuming:
            self._resume(w)
        return state

    def _call(self, w: Optional[Window], name: str, call):
        """``call()``; on a run with interrupts, when the window says so, a SIGINT at its k-th
        line first and, if it raised KeyboardInterrupt, the call again, as a user would."""
        if self.interrupts and w is not None and w.interrupt is not None and w.interrupt[0] == name:
            out = []
            hit, raised = sigint_at_line(w.interrupt[1], lambda: out.append(call()))
            if not hit:
                assert raised is None, raised
                return out[0]
            assert isinstance(raised, KeyboardInterrupt), raised
        return call()

    def _failed_pass(self, i: int, w: Window, loss) -> dict:
        """The pass's backward raises once the head's gradients arrived; the loop drops the
        window with zero_grad(), which recovers it (the parameters stepped count the step,
        the rest of the window is discarded), and torch is given the state it left."""
        Boom.armed = RuntimeError("a failed backward")
        try:
            with pytest.raises(RuntimeError, match="a failed backward"):
                loss.backward()
        finally:
            Boom.armed = None
        if hasattr(self.model, "reset_iter_state"):  # FSDP2 asks for it after a backward that raised
            self.model.reset_iter_state()
        self.opt.zero_grad()
        self.passes.clear()
        self.splits_agree = False  # device parameters are stepped when a window closes: not this one
        if self.torch is not None:
            self.torch.take(self.opt.state_dict()["state"], self.index_names())
            self.rollback_error = 0.0
        state = self.state()
        if w.resume and self.resuming:
            self._resume(w)
        return state

    def mixed(self) -> bool:
        """Some compute copies stay fp32 (keep_fp32): the forward runs under autocast."""
        return any(p.dtype == torch.float32 for p in self.model.parameters() if p.requires_grad)

    def index_names(self) -> dict:
        """state_dict index -> name of each trainable parameter."""
        names = {id(p): n for n, p in self.model.named_parameters() if p.requires_grad}
        params = [p for g in groups_of(self.model) for p in g["params"]]
        return {j: names[id(p)] for j, p in enumerate(params) if id(p) in names}

    def _write_moment(self, factor) -> None:
        """Scale l1.weight's first moment through ``opt.state`` (a user's own reset), once it
        has stepped (torch has no state before)."""
        p = self.model.l1.weight
        entry = self.opt.state[p]
        if int(entry["step"]) == 0:
            return
        entry["exp_avg"] = entry["exp_avg"].float() * factor
        if self.torch is not None:
            theirs = self.torch.opt.state[self.torch.params["l1.weight"]]
            theirs["exp_avg"] = theirs["exp_avg"] * factor

    def _resume(self, w: Window) -> None:
        """A new model and wrapper from this run's checkpoint, or (``w.migrate``, when torch
        runs beside) from the plain torch optimizer's: no masters, which come from the model's
        fp32 weights (docs/checkpoints.md)."""
        if w.migrate and self.torch is not None:
            opt_state = clone_tree(self.torch.opt.state_dict())
            model_state = {n: p.detach().clone() for n, p in self.torch.params.items()}
            self.migrated = True
        else:
            opt_state = clone_tree(self._call(w, "state_dict", self.opt.state_dict))
            model_state = clone_tree(self.model.state_dict())
        self.opt.close()
        self.resumes += 1
        self.model = self._new_model()
        self.model.load_state_dict(model_state)
        self._wrap(opt_state, w)
        if self.torch is not None:
            self.torch.resumed()

    def _new_model(self):
        torch.manual_seed(self.program.seed)
        model = Net()
        model.l2.register_forward_hook(lambda module, args, out: Boom.apply(out))  # _failed_pass
        return self.shard(model)

    def state(self) -> dict:
        """Everything a later step depends on: the checkpoint and the compute copies (whole
        tensors, also when sharded)."""
        return {"optim": gathered(self.opt.state_dict()), "model": gathered(self.model.state_dict())}

    def state_now(self) -> dict:
        """In the middle of a window: the host state and the compute copies."""
        return {"optim": [gathered(dict(entry.items())) for entry in self.opt.state.values()],
                "model": gathered(self.model.state_dict())}

    def check_against_torch(self, i: int) -> None:
        params = [p for g in groups_of(self.model) for p in g["params"]]
        index_of = {id(p): j for j, p in enumerate(params)}
        state = self.opt.state_dict()["state"]
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            ours, ref_p = state[index_of[id(p)]], self.torch.params[n]
            theirs = self.torch.opt.state.get(ref_p, {})
            master, tol = ours["master"].view(ref_p.shape), 1e-5 + self.rollback_error
            assert normwise(master, ref_p.detach()) < tol, (i, n)
            assert torch.equal(p.detach(), master.to(p.dtype)), (i, n)
            if self.program.algorithm != "adamw":
                continue
            assert int(ours["step"]) == int(theirs.get("step", 0)), (i, n, int(ours["step"]), theirs.get("step"))
            if theirs:
                assert normwise(ours["exp_avg"].view(ref_p.shape), theirs["exp_avg"]) < tol, (i, n)
                assert normwise(ours["exp_avg_sq"].view(ref_p.shape), theirs["exp_avg_sq"]) < tol, (i, n)

    def close(self):
        self.opt.close()


def check_norm(got, want, where):
    """The returned norm (accumulated in float64) against torch's float32 one."""
    if math.isfinite(want):
        assert abs(got - want) <= 1e-5 * want, (where, got, want)
    else:
        assert not math.isfinite(got), (where, got, want)


def gathered(obj):
    """``clone_tree`` with each DTensor's whole tensor (a collective: every rank calls it alike)."""
    return clone_tree(obj, lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone())


# Configurations whose every window must step bit for bit like SMALL's (the one checked
# against torch): the bytes per chunk, where the kept gradient lives (it differs only without
# accumulators: the programs of every third seed), the step's tail overlapped with the next
# forward, the same run without its resumes. ``device`` keeps about half of the state on the
# device (the CPU here) and takes the other half at each resume, ``auto`` moves what a fake
# device's memory reading leaves room for after the third window: both bit for bit as long as
# no step was rolled back and no pass failed (a device parameter is stepped once, when the
# window closes). ``head fp32`` keeps the head's compute copy in fp32, so its forward runs
# under autocast and only its own check against torch applies. ``interrupted`` delivers a
# SIGINT at a line of step(), zero_grad() or a state round trip where the program says, then
# makes the call again.
CONFIGS = {
    "small rings": lambda model, resumes: dict(SMALL),
    "one chunk": lambda model, resumes: dict(pinned_bytes=4 * 65536, num_slots=4),
    "host grad copy": lambda model, resumes: dict(SMALL, grad_copy="host"),
    "overlap_forward": lambda model, resumes: dict(SMALL, overlap_forward=model),
    "device": lambda model, resumes: dict(SMALL, gpu_state=HALF_STATE if resumes % 2 == 0 else 0),
    "auto": lambda model, resumes: dict(SMALL, gpu_state="auto"),
    "never resumed": lambda model, resumes: dict(SMALL),
    "head fp32": lambda model, resumes: dict(SMALL, keep_fp32=[model.head.weight]),
    "interrupted": lambda model, resumes: dict(SMALL),
}
SPLIT = ("device", "auto")
OWN_NUMERICS = ("head fp32",)  # the forward under autocast: checked against torch only
# The fake device for "auto": 4 GiB (its margin) + 40000 bytes, windows peaking at 1000 bytes.
AUTO_READING = (4 * (1 << 30) + 40_000, 1000)


@contextlib.contextmanager
def expected_warnings():
    """The programs' skipped steps, zero_grad() without step() and failed passes warn, as documented."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cpu_offload: (zero_grad|optimizer step skipped|backward pass)", RuntimeWarning)
        yield


def run_program(seed, algorithm, state_dtype=torch.float32):
    program = draw(seed, algorithm)
    with mock.patch.object(device_state, "memory_reading", lambda device: AUTO_READING):
        run_configs(program, state_dtype)


def run_configs(program, state_dtype):
    runs = {name: Run(program, options, state_dtype=state_dtype, resumes=name != "never resumed",
                      interrupts=name == "interrupted") for name, options in CONFIGS.items()}
    base = runs["small rings"]
    try:
        with expected_warnings():
            for i, w in enumerate(program.windows):
                states = {name: run.window(i, w) for name, run in runs.items()}
                for name, run in runs.items():
                    if run.torch is not None:
                        run.check_against_torch(i)
                    if (name in OWN_NUMERICS or (name in SPLIT and not base.splits_agree)
                            or (name == "never resumed" and base.migrated)):
                        continue
                    assert_bit_equal(states[name], states["small rings"], f"window {i} ({w}), {name}")
    finally:
        for run in runs.values():
            run.close()
    if longest_stepped_stretch(program) > 3:  # "auto" settled: it moved state
        assert runs["auto"].moved


def longest_stepped_stretch(program) -> int:
    """The most windows one wrapper (between resumes) closes with step() after a backward."""
    longest = stretch = 0
    for w in program.windows:
        stretch += w.passes > 0 and not w.drop
        longest = max(longest, stretch)
        stretch = 0 if w.resume else stretch
    return longest


@pytest.mark.parametrize("algorithm, state_dtype", [("adamw", torch.float32), ("adamw", torch.bfloat16),
                                                    ("sign_sgd", torch.float32)], ids=["adamw", "adamw-bf16", "sign_sgd"])
@pytest.mark.parametrize("seed", range(6))
def test_a_random_program_steps_alike_on_every_configuration_and_like_torch(sigint_raises, seed, algorithm,
                                                                              state_dtype):
    run_program(seed, algorithm, state_dtype)
