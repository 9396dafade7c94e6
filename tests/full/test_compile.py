# torch.compile around a full-offload model: compiled blocks under non-reentrant activation
# checkpointing (the layout of FSDP2 training scripts) train as the same blocks uncompiled,
# compile no more after the first step, and recover from a backward that raised. The CUDA
# cases are marked gpu (skipped without CUDA); there inductor's own kernels are checked for
# the compile count and finite weights only, since they round unlike eager ones.
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from cpu_offload import offload_optimizer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class CheckpointedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()  # NOTE: frees the graphs' fake tensors, which later tests would find


def train(model, steps, *, die_at=None, graphs=None):
    """AdamW with full offload; the backward of step ``die_at`` raises in a gradient hook
    and the loop goes on with the next batch, as a training loop that skips a bad batch."""
    off = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), offload="full")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 32, generator=gen).to(device, torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        if step == die_at:
            def fail(grad):
                raise RuntimeError("bad batch")
            handle = model.head.weight.register_hook(fail)  # NOTE: before any block's: same order compiled
            with pytest.raises(RuntimeError, match="bad batch"):
                loss.backward()
            with pytest.warns(RuntimeWarning, match="raised"):  # recovered before the next forward
                model(torch.zeros_like(x))
            handle.remove()
            continue
        loss.backward()
        off.step()
        off.zero_grad()
        if graphs is not None:
            graphs.append(counters["stats"]["unique_graphs"])
    off.close()
    return {name.replace("._orig_mod", ""): p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("device,backend,how,die_at", [
    ("cpu", "aot_eager", "torch.compile(block)", None),
    ("cpu", "aot_eager", "block.compile()", None),
    ("cpu", "aot_eager", "torch.compile(block)", 2),
    ("cpu", "aot_eager", "block.compile()", 2),
    pytest.param("cuda", "aot_eager", "torch.compile(block)", 2, marks=CUDA),
    pytest.param("cuda", "inductor", "torch.compile(block)", None, marks=CUDA),
])
def test_compiled_checkpointed_blocks_train_as_uncompiled_and_compile_only_at_the_first_step(device, backend, how,
                                                                                              die_at):
    """Before, the optimizer kept a process-wide module hook registered during every backward;
    the blocks' recompute inside backward then picked a graph compiled for it, and the first
    backward raised CheckpointError ("Recomputed values ... have different metadata"). The
    dtype hint's hooks, removed at the end of the first forward, did the same."""
    torch.manual_seed(0)
    eager = CheckpointedNet().to(device)
    compiled = copy.deepcopy(eager)
    if how == "block.compile()":
        for block in compiled.blocks:
            block.compile(backend=backend)
    else:
        compiled.blocks = nn.ModuleList(torch.compile(block, backend=backend) for block in compiled.blocks)
    init = {name: p.detach().clone() for name, p in eager.named_parameters()}
    graphs = []
    expected = train(eager, 6, die_at=die_at)
    got = train(compiled, 6, die_at=die_at, graphs=graphs)
    assert graphs[-1] == graphs[0] > 0, graphs  # no graph compiled after the first step
    for name, value in expected.items():
        if backend == "inductor":
            assert torch.isfinite(got[name]).all() and not torch.equal(got[name], init[name]), name
        else:
            assert torch.equal(got[name], value), name


def test_a_backward_under_compiled_autograd_is_refused_by_name_and_changes_nothing():
    """Compiled autograd traces the parameters' post-accumulate-grad hooks into its graph, so
    dynamo ran full offload's hook symbolically and failed inside it with its own
    "queue_callback() is only supported when Compiled Autograd is enabled with fullgraph=True".
    The hook now refuses before it does anything, saying what to turn off; the next plain
    backward steps as if the refused one had never run."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    torch.manual_seed(0)
    refused = CheckpointedNet()
    plain = copy.deepcopy(refused)
    offs = [offload_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), offload="full") for m in (refused, plain)]
    x = torch.randn(8, 32).bfloat16()
    for fullgraph in (False, True):
        loss = refused(x).float().pow(2).mean()
        with pytest.raises(RuntimeError, match=r"cpu_offload: .*compiled autograd.* offload='full'"):
            with compiled_autograd._enable(torch.compile(backend="eager", fullgraph=fullgraph)):
                loss.backward()
    for model, off in zip((refused, plain), offs):
        model(x).float().pow(2).mean().backward()
        off.step()
        off.zero_grad()
    for (name, got), want in zip(refused.named_parameters(), plain.parameters()):
        assert torch.equal(got, want), name
    for off in offs:
        off.close()


def test_a_compile_flag_set_by_another_thread_does_not_refuse_this_backward(monkeypatch):
    """torch.compiler.is_compiling() reads a process-wide flag, set while any thread compiles:
    checked by the compiled-autograd refusal, it refused the backward of a thread that was not
    compiling. The refusal asks whether dynamo traces this call instead."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # another thread compiling
    torch.manual_seed(0)
    model = CheckpointedNet()
    off = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), offload="full")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 32).bfloat16()).float().pow(2).mean().backward()
    off.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    off.close()
