# Shared pieces of the tests (not a test module; every test folder imports it as
# `helpers`: pyproject.toml puts tests/ on sys.path):
#   - the ISA parametrization, seeded generators, the loading of a benchmark script as a
#     module, a free TCP port, a backward that raises when armed, and a SIGINT delivered at
#     a chosen line of the package;
#   - full offload's small model on CPU parameters (two param groups, a parameter used on
#     some micro-batches only, one never used, one frozen), its training runs, and their
#     replay with the reference or torch;
#   - the clipped training run of full offload and snapshots of its host state;
#   - a gate that holds the worker's kernels until a forward (overlap_forward) waits;
#   - for the framework tests: a tiny Llama built from a config (nothing downloaded), random
#     token data, the bf16/fp32-master reference optimizer full offload is compared with,
#     and the comparison.
#
# Scope: deterministic CPU runs a few seconds long. Non-goals: any framework import (each
# framework test module imports its framework through pytest.importorskip; tiny_llama
# imports transformers when called).

from __future__ import annotations

import importlib.util
import io
import linecache
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_offload import _C, kernels
from cpu_offload._full.optimizer import FullCPUOffloadOptimizer
from cpu_offload._full.pipeline import Pipeline
from cpu_offload.optim import SignSGD
from cpu_offload.reference import adamw_reference_, sign_sgd_reference_

# ------------------------------------------------ ISAs, seeds, benchmarks, ports


ALL_ISAS = list(_C.known_isas())


def isa_params():
    """One pytest param per known ISA, skipped with a reason when this CPU lacks it."""
    available = kernels.available_isas()
    return [
        pytest.param(name, marks=pytest.mark.skipif(
            name not in available, reason=f"this CPU lacks {name} (runs {available})"))
        for name in ALL_ISAS
    ]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def load_benchmark(file_name: str, module_name: str):
    """benchmarks/<file_name> imported as ``module_name`` (registered in sys.modules, where
    dataclasses and pickling look a module up)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / file_name
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def refused_by_name(main, argv: list, path: Path, content, capsys) -> str:
    """``path`` written with ``content`` (None: left missing), then a report script's
    ``main(argv)``: it must exit 2 with a message naming the file; returns that message."""
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list, world: int, timeout_s: float = 150, **env) -> None:
    """Run ``python script *args`` as ``world`` gloo ranks started like torchrun (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*; ``env`` added); fails the test on a
    rank's error (its output shown) or after ``timeout_s``."""
    if not torch.distributed.is_gloo_available():
        pytest.skip("torch built without gloo")
    import cpu_offload

    port = str(free_port())
    root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_offload.__file__)))  # the ranks import it too
    tests = os.path.dirname(os.path.abspath(__file__))  # and this file
    path = os.pathsep.join([root, tests] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    procs = []
    local = min(world, 2)  # NOTE: 4 ranks as 2 "hosts" of 2: one CPU each on a 2-core machine
    for rank in range(world):
        rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                        LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local), OMP_NUM_THREADS="1",
                        PYTHONPATH=path, **env)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{os.path.basename(script)} {' '.join(args)}: the ranks timed out")
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]


def rank_main(work) -> None:
    """A rank's process of ``run_ranks``: run ``work()``, print its traceback if it raises,
    and exit with its status."""
    import traceback

    try:
        work()
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    # NOTE: leave without the interpreter's teardown: torch's gloo run-loop threads can abort
    # the process there ("terminate called without an active exception", about one exit in
    # ten on torch 2.13) after everything above succeeded and the process group was destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_interruptible_line(frame, event) -> bool:
    """A line event where a test may raise as a Ctrl-C would. NOTE: not at a ``with`` line:
    CPython reports it again when the block exits, and an exception raised by a trace
    function there skips ``__exit__``, which no real SIGINT can do (its handler runs only
    where the interpreter checks for signals: a backward jump, a call, a function's entry)."""
    return event == "line" and not linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with ")


def _in_finalizer(frame) -> bool:
    """Whether ``frame`` runs under a ``__del__``, which the garbage collector may run at any
    point: a KeyboardInterrupt raised there is reported as unraisable and dropped (Python's
    rule, whoever raises it), so such lines are not counted."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def sigint_at_line(k: int, call, start: str | None = None, signum: int = signal.SIGINT) -> tuple:
    """Run ``call()`` with SIGINT (``signum``) raised at the ``k``-th line the package runs on
    this thread (its handler then runs as a real signal's would: at once, or where
    ``deferred_interrupts`` delivers it); with ``start``, counting only the lines run inside the
    first call of the package's function of that name. Returns (whether ``call`` ran ``k`` such
    lines (``is_interruptible_line``), what it raised or None). For SIGINT, needs the
    ``sigint_raises`` fixture."""
    package = str(Path(kernels.__file__).parent)
    seen, counting = [0], {"now": start is None, "done": False}

    def local(frame, event, arg):
        if counting["now"] and is_interruptible_line(frame, event):
            seen[0] += 1
            if seen[0] == k:
                signal.raise_signal(signum)
        if event == "return" and frame.f_code.co_name == start:
            counting.update(now=False, done=True)
        return local

    def entered(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package) or _in_finalizer(frame):
            return None
        if frame.f_code.co_name == start and not counting["done"]:
            counting["now"] = True
        return local
    sys.settrace(entered)
    raised = None
    try:
        call()
    except BaseException as e:  # NOTE: KeyboardInterrupt is the expected one
        raised = e.with_traceback(None)  # NOTE: frees the interrupted frames, as a loop that goes on does
    finally:
        sys.settrace(None)
    return seen[0] >= k, raised


class Boom(torch.autograd.Function):
    """Identity whose backward raises the exception ``Boom.armed`` once (then disarms)."""

    armed = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed is not None:
            exc, Boom.armed = Boom.armed, None
            raise exc
        return g


class StateNet(nn.Module):
    """Two layers (seeded), the second's gradients first, a Boom between them, and a layer
    that never gets a gradient: the "optimizer" mode's tests' model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 16)
        self.b = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)  # never gets a gradient

    def forward(self, x):
        return self.b(Boom.apply(torch.tanh(self.a(x))))


def sharded_state_nets(count=2) -> list:
    """``count`` identical StateNets under FSDP2 on a one-rank CPU mesh (each layer and the
    root sharded); needs the ``gloo_group`` fixture."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    models = []
    for _ in range(count):
        model = StateNet()
        fully_shard(model.a, mesh=mesh)
        fully_shard(model.b, mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    return models


# ------------------------------------------------ full offload on CPU parameters

# gpu_state= for about half of Net's 6293 trained elements with fp32 AdamW state (12 B each),
# no accumulator: those parameters are stepped by the device step (on the CPU here).
HALF_STATE = 3100 * 12
# Two 4 KiB slots per ring: l2's weight (4096 bf16 elements, 8 KiB) spans chunks.
SMALL = dict(pinned_bytes=4 * 4096, num_slots=2)


class PlainNet(nn.Module):
    """Three linear layers, every parameter trained by every batch."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(24, 64)
        self.l2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(F.gelu(self.l2(F.gelu(self.l1(x)))))


class Net(PlainNet):
    """PlainNet with a parameter used on some batches, one never used and a frozen one."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.randn(8) * 0.1)  # used on some micro-batches only
        self.unused = nn.Parameter(torch.randn(5))  # never receives a gradient
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x, use_extra=False):
        y = super().forward(x) + self.frozen
        if use_extra:
            y = y * self.extra
        return y


def build(kind, *, lr=1e-2, seed=0):
    torch.manual_seed(seed)
    model = Net()
    p = dict(model.named_parameters())
    groups = [
        {"params": [p["l1.weight"], p["l1.bias"], p["head.weight"], p["head.bias"], p["unused"], p["frozen"]],
         "weight_decay": 0.1},
        {"params": [p["l2.weight"], p["l2.bias"], p["extra"]], "lr": lr * 0.3, "weight_decay": 0.02},
    ]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = SignSGD(groups, lr=lr * 0.1, weight_decay=0.05)
    return model, opt


def batches(step, k):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(4, 24, generator=g), m == 0 and step % 2 == 0) for m in range(k)]


def capture(model):
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p, n=n: grads.setdefault(n, []).append(p.grad.detach().float().clone()))
    return grads


def run(kind, k, steps, **opts):
    """Train with full offload; return the model, the wrapper, per-step grads."""
    model, opt = build(kind)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = capture(model)  # registered first: runs before the offload hook
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, **opts)
    sched = torch.optim.lr_scheduler.StepLR(off, step_size=2, gamma=0.5)
    history = []
    for s in range(steps):
        grads.clear()
        for x, extra in batches(s, k):
            model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
        sched.step()
        history.append({n: list(g) for n, g in grads.items()})
    return model, off, init, history


def expected(kind, init, history, *, exact, moment_dtype=torch.float32):
    """Replay the captured gradients with the reference (exact, moments in
    ``moment_dtype``) or torch (fp32)."""
    model, opt = build(kind)
    params = {n: nn.Parameter(init[n].clone().float(), requires_grad=p.requires_grad)
              for n, p in model.named_parameters()}
    order = [n for n, _ in model.named_parameters()]
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[by_id[id(p)]] for p in g["params"]]}
              for g in opt.param_groups]
    ref = (torch.optim.AdamW(groups) if kind == "adamw" else SignSGD(groups, lr=groups[0]["lr"]))
    sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    steps = {n: 0 for n in order}
    moments = {n: (torch.zeros_like(params[n], dtype=moment_dtype), torch.zeros_like(params[n], dtype=moment_dtype))
               for n in order}
    for grads in history:
        for n in order:
            params[n].grad = None
            if n in grads:
                total = grads[n][0].clone()
                for g in grads[n][1:]:
                    total += g  # fp32 sum in arrival order, like the host accumulator
                params[n].grad = total
        if exact:
            for group in ref.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    n = next(n for n in order if params[n] is p)
                    with torch.no_grad():
                        if kind == "adamw":
                            steps[n] += 1
                            adamw_reference_(p, p.grad, *moments[n], steps[n], lr=group["lr"], beta1=group["betas"][0],
                                             beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"])
                        else:
                            sign_sgd_reference_(p, p.grad, lr=group["lr"], weight_decay=group["weight_decay"])
            ref._opt_called = True  # stepped by hand: keep the scheduler's order check quiet
        else:
            ref.step()
        sched.step()
    return {n: p.detach() for n, p in params.items()}


def clone_tree(obj, tensor=lambda t: t.detach().clone()):
    """A deep copy of nested mappings, lists and tuples, each tensor copied by ``tensor``."""
    if torch.is_tensor(obj):
        return tensor(obj)
    if isinstance(obj, Mapping):
        return {k: clone_tree(v, tensor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v, tensor) for v in obj)
    return obj


def assert_bit_equal(a, b, where: str) -> None:
    """Two nested structures (``clone_tree``'s) are equal: tensors bit for bit in dtype, shape
    and values (NaN where NaN), the rest by value; ``where`` names the first difference."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.dtype.is_floating_point and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), where
    elif isinstance(a, Mapping):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for j, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}/{j}")
    else:
        assert a == b, (where, a, b)


def through_torch_save(obj):
    """``obj`` as ``torch.save`` then ``torch.load`` give it back (a checkpoint written to disk)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def assert_same_state(a: dict, b: dict) -> None:
    """Two ``{name: (values...)}`` states are equal bit for bit (tensors) or by value."""
    assert a.keys() == b.keys()
    for n in a:
        for x, y in zip(a[n], b[n]):
            assert (x == y) if not torch.is_tensor(x) else torch.equal(x, y), n


# ------------------------------------------------ the optimizers' internals
# NOTE: the tests' only ways into the wrappers' private state, for what the public API does
# not show (host records and their window marks, rollback calls, host bytes, the protocol
# phase, staging rings): a rename inside the library changes these lines only.


def records_of(off) -> list:
    """A FullCPUOffloadOptimizer's host records (host_state.ParamRecord), in state_dict order."""
    return off._records


def host_bytes_of(off) -> int:
    return off._host.nbytes


def phase_of(off):
    return off._proto.phase


def staging_rings_of(off) -> tuple:
    """The (d2h, h2d) pinned rings of a FullCPUOffloadOptimizer."""
    return off._pipeline.d2h, off._pipeline.h2d


def worker_parts_of(off) -> tuple:
    """The (transfer engine, chunk runner) of a FullCPUOffloadOptimizer's worker."""
    return off._transfer, off._pipeline._runner


def window_records_of(off) -> list:
    """The records holding a gradient of the open window."""
    return off._validator.window_records()


def count_rollbacks(monkeypatch) -> list:
    """A list that gets the piece count of every rollback (validation.py, AdamW or SignSGD) from now on."""
    from cpu_offload._full import validation

    rollbacks = []
    for name in ("rollback_adamw_pieces_", "rollback_sign_sgd_pieces_"):
        real = getattr(validation, name)
        monkeypatch.setattr(validation, name,
                            lambda *a, real=real, **kw: (rollbacks.append(len(a[0])), real(*a, **kw))[1])
    return rollbacks


def watch_rollbacks(off, seen) -> None:
    """Call ``seen(stepped pieces)`` before each rollback of ``off``'s validator."""
    real = off._validator._rollback
    off._validator._rollback = lambda stepped: (seen(stepped), real(stepped))[1]


def written_elsewhere(rec) -> bool:
    """Whether a record's compute copy was written since the library last wrote it (its
    version counters or storage moved): the next window then compares it with its master."""
    from cpu_offload._full.host_state import _version_of

    return _version_of(rec) != rec.version


def window_scale_of(off) -> float:
    """The factor on the open window's gradients (clip coefficients, scale_grads_): during a
    rollback for a redo, the one the redo steps with."""
    return off._validator.scale


def state_staging_of(opt):
    """A StateOffloadOptimizer's staging (_state/staging.py)."""
    return opt._staging


def named(model, off):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(rec.param)]: rec for rec in records_of(off)}


# ------------------------------------------------ clipping and the non-finite guard

STEPS = 20
LOSS_SCALES = [0.5, 2.0, 1.0, 3.0, 0.3, 1.5]  # varies the norm so that some steps clip and others do not


def normwise(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def train(kind, k, steps, *, clip=None, loss_scale=lambda s: LOSS_SCALES[s % len(LOSS_SCALES)], clip_with=None,
          **opts):
    """Full offload with ``clip_grad_norm_(clip)`` before each step (the wrapper's, or
    ``clip_with(model, clip)``); returns the model, the wrapper, the initial weights, the
    captured grads and the norms."""
    model, opt = build(kind)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = capture(model)
    off = FullCPUOffloadOptimizer(opt, grad_accum_steps=k, **SMALL, **opts)
    history, norms = [], []
    for s in range(steps):
        grads.clear()
        for x, extra in batches(s, k):
            (model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean() * loss_scale(s)).backward()
        if clip is not None:
            norms.append(off.clip_grad_norm_(clip) if clip_with is None else clip_with(model, clip))
        off.step()
        off.zero_grad()
        history.append({n: sum(g[1:], g[0].clone()) for n, g in grads.items()})
    return model, off, init, history, norms


def fp32_reference(kind, init):
    """Named fp32 copies of ``build(kind)``'s parameters from ``init`` and the same optimizer over them."""
    model, opt = build(kind)
    params = {n: nn.Parameter(init[n].float().clone()) for n, _ in model.named_parameters()}
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [params[by_id[id(p)]] for p in g["params"] if p.requires_grad]} for g in opt.param_groups]
    return params, type(opt)(groups, lr=groups[0]["lr"])

def snapshot(off):
    def copy(t):  # SignSGD keeps no moments
        return None if t is None else t.clone()

    return {r.name: (r.master.clone(), copy(r.exp_avg), copy(r.exp_avg_sq), r.step) for r in records_of(off)}


def train_step(model, off, s, k, *, loss_factor=1.0):
    for x, extra in batches(s, k):
        (model(x.to(torch.bfloat16), use_extra=extra).float().pow(2).mean() * loss_factor).backward()


def check_stepped_once(model, off, before, grads, coef, where) -> None:
    """Each parameter of ``model`` equals ``reference.py``'s AdamW (SignSGD) on its state in
    ``before`` (``snapshot``) with the window's ``grads`` (``capture``), the groups' current
    values and ``coef``, bit for bit; one without a gradient is unchanged."""
    from cpu_offload.reference import adamw_reference_, sign_sgd_reference_

    for name, rec in named(model, off).items():
        master, exp_avg, exp_avg_sq, step = (t.clone() if torch.is_tensor(t) else t for t in before[rec.name])
        if name not in grads:
            assert torch.equal(rec.master, master) and rec.step == step, (where, name)
            continue
        group = off.param_groups[rec.group]
        grad = sum(grads[name][1:], grads[name][0].clone()).reshape(-1)  # fp32 sum in arrival order
        if "betas" not in group:  # SignSGD: sign(coef * g) = sign(g)
            sign_sgd_reference_(master, grad, lr=group["lr"], weight_decay=group["weight_decay"])
        else:
            adamw_reference_(master, grad, exp_avg, exp_avg_sq, step + 1, lr=group["lr"], beta1=group["betas"][0],
                             beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                             grad_scale=coef)
        assert rec.step == step + 1 and torch.equal(rec.master, master), (where, name)
        for moment, expected in ((rec.exp_avg, exp_avg), (rec.exp_avg_sq, exp_avg_sq)):
            assert moment is expected is None or torch.equal(moment, expected), (where, name)


def check_unchanged(off, before, weights):
    for r in records_of(off):
        m, ea, eas, st = before[r.name]
        assert torch.equal(r.master, m) and torch.equal(r.exp_avg, ea) and torch.equal(r.exp_avg_sq, eas), r.name
        assert r.step == st and torch.equal(r.param.detach(), weights[r.name]), r.name


# ------------------------------------------------ the framework tests

VOCAB = 128
SEQ = 16

# Full offload against the bf16 reference: the two runs see the same bf16
# weights and gradients up to the rounding of AdamW's fp32 arithmetic (native
# kernel vs torch), which can flip a bf16 rounding of a weight now and then.
# Measured: at most 0.004 over 20-40 steps; 0.02 is 0.5% of a loss near 4.
BF16_LOSS_ATOL = 2e-2


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def token_rows(n: int, *, seed: int = 1234, seq: int = SEQ) -> torch.Tensor:
    """``n`` rows of ``seq`` tokens with a learnable pattern (each token is the
    previous one plus a per-row stride, mod the vocabulary) so losses fall."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(3, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 3, (n, 1), generator=g)
    return (start + stride * torch.arange(seq)) % (VOCAB - 3) + 3


def adamw(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


class Bf16MasterAdamW(torch.optim.Optimizer):
    """The reference for full offload: the model trains in bf16; fp32 masters
    are stepped by a plain torch.optim.AdamW with the bf16 gradients cast to
    fp32 (summed in fp32 over accumulated backward passes, as full offload
    does), and each step writes the masters back rounded to bf16.

    Build it over the fp32 model's parameters; it casts them to bf16 in place
    (as full offload does). LR schedulers drive the inner AdamW's groups.
    ``max_grad_norm`` clips the fp32 gradient sums with torch.nn.utils.clip_grad_norm_.
    """

    def __init__(self, params, max_grad_norm=None, **adamw_options):
        params = list(params)
        self.max_grad_norm = max_grad_norm
        self.masters = [p.detach().clone().float() for p in params]
        self.compute = params
        self.inner = torch.optim.AdamW(self.masters, **adamw_options)
        self.defaults = self.inner.defaults
        self.optimizer = self.inner
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                     "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self.hooks = []
        for p, m in zip(params, self.masters):
            p.data = p.data.to(torch.bfloat16)
            self.hooks.append(p.register_post_accumulate_grad_hook(lambda p, m=m: self._accumulate(p, m)))

    def close(self) -> None:
        """Stop taking the model's gradients (before another optimizer trains it)."""
        for h in self.hooks:
            h.remove()

    @staticmethod
    @torch.no_grad()
    def _accumulate(p, m):
        g = p.grad.float()
        m.grad = g if m.grad is None else m.grad.add_(g)
        p.grad = None

    # NOTE: properties, not copies: inner.load_state_dict (accelerate runs one at
    # prepare time) installs new group dicts, and the scheduler must follow them.
    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.inner.param_groups = groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for m in self.masters if m.grad is not None], self.max_grad_norm)
        self.inner.step()
        for p, m in zip(self.compute, self.masters):
            p.copy_(m.to(torch.bfloat16))
            m.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for p, m in zip(self.compute, self.masters):
            p.grad = m.grad = None

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)


def assert_trains(losses, line: str = "") -> None:
    """The mean loss of the last quarter is clearly below that of the first."""
    q = max(1, len(losses) // 4)
    first, last = sum(losses[:q]) / q, sum(losses[-q:]) / q
    assert last < first - 0.1, f"loss did not fall: {first:.4f} -> {last:.4f}; {line}"


def loss_report(name: str, got, want) -> tuple[float, str]:
    """Largest absolute difference of two loss curves and a printable line."""
    got = [float(x) for x in got]
    want = [float(x) for x in want]
    assert len(got) == len(want), f"{name}: {len(got)} losses vs {len(want)}"
    diff = max(abs(a - b) for a, b in zip(got, want))
    line = (f"{name}: {len(got)} losses, max |diff| {diff:.3g}; "
            f"first {got[0]:.5f} vs {want[0]:.5f}, last {got[-1]:.5f} vs {want[-1]:.5f}")
    print(line)
    return diff, line


REPLAY_HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class ReplayRun:
    """A model wrapped by full offload (AdamW with REPLAY_HP), the fp32 sum of the gradients
    each window delivered to the optimizer (``window``: name -> sum, emptied by the test at
    each window), and torch AdamW on fp32 copies of the initial weights to replay them.
    Subclasses build the model (seeded) and define ``backward``."""

    def __init__(self, model, *, k=1, seed=0, **opts):
        self.model = model
        self.init = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.window = {}
        for n, p in model.named_parameters():
            if p.requires_grad:  # registered first: runs before the offload hook
                p.register_post_accumulate_grad_hook(lambda p, n=n: self._seen(n, p))
        self.opt = FullCPUOffloadOptimizer(torch.optim.AdamW(model.parameters(), **REPLAY_HP), grad_accum_steps=k,
                                           **{**SMALL, **opts})
        self.ref_params = {n: nn.Parameter(t.float().clone()) for n, t in self.init.items()}
        self.ref = torch.optim.AdamW(list(self.ref_params.values()), **REPLAY_HP)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def _seen(self, n, p):
        g = p.grad.detach().float().clone()
        self.window[n] = self.window[n] + g if n in self.window else g

    def ref_step(self, grads, zero_held=()):
        """One torch AdamW step with ``grads``; names without one are skipped, as torch skips
        them, or stepped with zeros when in ``zero_held`` (a zeroed ``.grad``)."""
        for n, p in self.ref_params.items():
            p.grad = grads[n].clone() if n in grads else torch.zeros_like(p) if n in zero_held else None
        self.ref.step()

    def names(self) -> dict:
        return {id(p): n for n, p in self.model.named_parameters()}

    def steps(self) -> dict:
        names = self.names()
        return {names[id(r.param)]: r.step for r in records_of(self.opt)}

    def ref_steps(self) -> dict:
        """torch's step counts of the parameters full offload holds (the trainable ones)."""
        held = self.steps()
        return {n: int(self.ref.state[p]["step"]) if p in self.ref.state else 0 for n, p in self.ref_params.items()
                if n in held}

    def masters(self) -> dict:
        names = self.names()
        return {names[id(r.param)]: r.master.clone() for r in records_of(self.opt)}

    def check(self):
        """Step counts equal torch's; masters within float32 rounding of torch's weights; each
        compute copy is its master rounded."""
        assert self.steps() == self.ref_steps()
        names = self.names()
        for rec in records_of(self.opt):
            n = names[id(rec.param)]
            torch.testing.assert_close(rec.master.view(rec.shape), self.ref_params[n].detach(), rtol=1e-5, atol=1e-6,
                                       msg=n)
            assert torch.equal(rec.param.detach(), rec.master.view(rec.shape).to(rec.param.dtype)), n


class FullOffloadMaker:
    """``make(model)`` for the train_* helpers: a full-offload AdamW per call, kept so the
    test can close them (their gradient hooks) when it ends."""

    def __init__(self, grad_accum_steps: int, **options) -> None:
        self.grad_accum_steps = grad_accum_steps
        self.options = options
        self.made: list = []

    def __call__(self, model):
        import cpu_offload

        self.made.append(cpu_offload.offload_optimizer(adamw(model.parameters()), offload="full",
                                                       grad_accum_steps=self.grad_accum_steps, **self.options))
        return self.made[-1]

    def close(self) -> None:
        for opt in self.made:
            opt.close()


def framework_clipping_and_option(train) -> list:
    """``train(make, clip)`` (losses of a framework run, its own clipping at 1.0 when
    ``clip``) twice over a full-offload AdamW of 2-pass windows: with the optimizer's
    ``max_grad_norm=1.0`` and the framework's clipping off, then the other way round."""
    runs = []
    for clip, option in ((False, 1.0), (True, None)):
        make = FullOffloadMaker(grad_accum_steps=2, max_grad_norm=option)
        try:
            runs.append(train(make, clip))
        finally:
            make.close()
    return runs


# ------------------------------------------------ the GPU tests' model (tests/gpu)

LM_VOCAB, LM_TOKENS = 4096, 128


class LM(nn.Module):
    """Embedding, MLP blocks with residuals, untied head: parameters dominate memory."""

    def __init__(self, d=256, blocks=2, vocab=LM_VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(blocks))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def tokens(step, micro=0, device="cuda"):
    g = torch.Generator().manual_seed(7919 * step + micro)
    return torch.randint(0, LM_VOCAB, (1, LM_TOKENS), generator=g).to(device)


def loss_fn(model, t):
    logits = model(t[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1))


def make_opt(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    other = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95))


def capture_local_grads(model):
    """Per-parameter local gradients of each backward, as fp32 on the CPU."""
    grads = {}
    for n, p in model.named_parameters():
        def hook(p, n=n):
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grads.setdefault(n, []).append(g.detach().float().cpu())
        p.register_post_accumulate_grad_hook(hook)
    return grads


def shard_blocks(model, world=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (world or torch.distributed.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ------------------------------------------------ holding the worker (overlap_forward)

class Gate:
    """Holds the worker's optimizer kernel calls while closed, until the caller waits for
    them (a drain, or a forward waiting for its weights); call number ``fail_at`` raises.
    ``accumulate``: hold the accumulation kernels too."""

    def __init__(self, monkeypatch, accumulate=False):
        self.opened = threading.Event()
        self.opened.set()
        self.fail_at = None
        self.calls = 0
        for name in ("adamw_step", "sign_sgd_step") + (("accumulate_",) if accumulate else ()):
            real = getattr(kernels, name)

            def gated(*args, real=real, **kwargs):
                assert self.opened.wait(30), "the gate was never opened"
                self.calls += 1
                if self.calls == self.fail_at:
                    raise RuntimeError("injected kernel failure")
                return real(*args, **kwargs)
            monkeypatch.setattr(kernels, name, gated)
        for name in ("drain", "wait_stepped"):
            real = getattr(Pipeline, name)

            def opening(pipeline, *args, real=real):
                self.opened.set()
                return real(pipeline, *args)
            monkeypatch.setattr(Pipeline, name, opening)

    def close(self):
        self.opened.clear()
