# The fused device AdamW kernel (cpu_offload/_full/device_kernel.py), on CUDA (marked gpu,
# skipped without CUDA): on fresh random data over a wide exponent range, subnormals
# included, at sizes around its block, with fp32 and bf16 moments and gradients, it equals
# the readable reference on the CPU bit for bit (master, moments, compute copy); the device
# step uses it, and so does benchmarks/host_stream.py's streamed share.
# Run: pytest -m gpu tests/gpu/test_device_kernel.py
import json

import pytest
import torch

from cpu_offload import offload_optimizer
from cpu_offload._full import device_kernel, device_state
from cpu_offload.reference import adamw_reference_
from helpers import LM, assert_same_state, load_benchmark, loss_fn, make_opt, records_of, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def bits(t):
    """The bit patterns of a float32 or bf16 tensor (NaN payloads and signed zeros included)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def spread(n, gen, low, high):
    """Normal values times powers of two drawn from [low, high): many binades at once."""
    return torch.randn(n, generator=gen) * torch.exp2(torch.randint(low, high, (n,), generator=gen).float())


@pytest.mark.parametrize("n", [1, 7, 2047, 2048, 2049, (1 << 20) + 3])
@pytest.mark.parametrize("state_dtype, grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_fused_adamw_equals_the_cpu_reference_bit_for_bit(n, state_dtype, grad_dtype):
    gen = torch.Generator().manual_seed(n * 31 + state_dtype.itemsize * 7 + grad_dtype.itemsize)
    for trial in range(3):
        hp = dict(lr=float(10 ** torch.empty(1).uniform_(-5, -2, generator=gen)),
                  beta1=float(torch.empty(1).uniform_(0.8, 0.95, generator=gen)),
                  beta2=float(torch.empty(1).uniform_(0.95, 0.9999, generator=gen)),
                  eps=float(10 ** torch.empty(1).uniform_(-10, -6, generator=gen)),
                  weight_decay=[0.0, 0.1, 0.01][trial], grad_scale=[1.0, 0.37, 1e-3][trial])
        step = [1, 2, 41][trial]
        p = spread(n, gen, -8, 4)
        g = spread(n, gen, -30, 6).to(grad_dtype)
        m = spread(n, gen, -30, 0).to(state_dtype)
        v = (spread(n, gen, -60, -4) ** 2).to(state_dtype)
        for t in (p, g, m, v):             # a quarter subnormal: moments decayed where gradients stay zero
            t[torch.rand(n, generator=gen) < 0.25] *= 2.0 ** -125
        g[: n // 5] = 0.0                  # zero gradients and a zero second moment
        v[: n // 7] = 0.0
        dev = [t.cuda() for t in (p, g, m, v)]
        out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        assert device_kernel.fused_adamw_available(*dev, out)
        device_kernel.fused_adamw_(*dev[:2], *dev[2:], step, out=out, **hp)
        adamw_reference_(p, g, m, v, step, **hp)
        for name, want, got in (("master", p, dev[0]), ("exp_avg", m, dev[2]), ("exp_avg_sq", v, dev[3]),
                                ("compute copy", p.to(torch.bfloat16), out)):
            differ = bits(want) != bits(got.cpu())
            assert not differ.any(), f"{name}: {int(differ.sum())} of {n} differ (trial {trial}, {hp})"


@pytest.fixture
def fused_check_done():
    """The fused step's one-time check (device_state.check_fused_step) has run on this GPU and
    passed, so a test that counts kernel calls sees only the device step's."""
    assert device_state._fused_step_usable(torch.device("cuda", torch.cuda.current_device()))


def test_the_device_step_runs_the_fused_kernel(monkeypatch, fused_check_done):
    calls = []
    real = device_state.fused_adamw_
    monkeypatch.setattr(device_state, "fused_adamw_", lambda *a, **k: (calls.append(a[0].numel()), real(*a, **k)))
    torch.manual_seed(0)
    model = LM().cuda()
    opt = offload_optimizer(make_opt(model), offload="full", gpu_state=1 << 40, pinned_bytes=1 << 21)
    loss_fn(model, tokens(0, 0)).backward()
    opt.step()
    assert sorted(calls) == sorted(p.numel() for p in model.parameters())
    opt.close()


def test_the_fused_step_passes_its_check_on_this_gpu():
    assert device_state.check_fused_step(torch.device("cuda", torch.cuda.current_device())) is None


def train_on_the_device(steps):
    """A seeded LM with all of its state on the GPU, trained ``steps`` steps; its state."""
    torch.manual_seed(0)
    model = LM().cuda()
    opt = offload_optimizer(make_opt(model), offload="full", gpu_state=1 << 40, pinned_bytes=1 << 21)
    for step in range(steps):
        loss_fn(model, tokens(step, 0)).backward()
        opt.step()
        opt.zero_grad()
    recs = records_of(opt)
    assert all(r.on_device for r in recs)
    state = {r.name: (r.master.cpu(), r.exp_avg.cpu(), r.exp_avg_sq.cpu(), r.step, r.param.detach().cpu()) for r in recs}
    opt.close()
    return state


def test_a_triton_kernel_that_cannot_compile_leaves_the_torch_operations_with_one_warning(monkeypatch):
    # Triton imports but its kernel fails to compile on this GPU: the check at the first device
    # step warns once, and the torch operations step the device records with the same bits
    # as the fused kernel.
    fused = train_on_the_device(3)

    class Uncompilable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("simulated Triton compilation error")
            return launch
    device_state._fused_step_usable.cache_clear()
    monkeypatch.setattr(device_kernel, "_kernel", lambda: Uncompilable())
    try:
        with pytest.warns(RuntimeWarning, match=r"fused AdamW step cannot be used on cuda:\d \(RuntimeError: "
                                                r"simulated Triton compilation error\)") as caught:
            passes = train_on_the_device(3)
    finally:
        device_state._fused_step_usable.cache_clear()
    assert sum("fused AdamW" in str(w.message) for w in caught) == 1
    assert_same_state(fused, passes)


@pytest.mark.parametrize("moments", ["bf16", "fp32"])
def test_the_host_stream_benchmark_steps_its_streamed_share_as_the_cpu_kernel(moments, tmp_path):
    """benchmarks/host_stream.py: the state streamed through GPU slots (every slot, one again)
    comes back bit for bit as the native CPU kernel leaves it; a whole run's rows add up."""
    bench = load_benchmark("host_stream.py", "host_stream_gpu")
    bench.check_same_bits(torch.bfloat16 if moments == "bf16" else torch.float32)
    out = tmp_path / "s.json"
    assert bench.main(["--numel", str(2 * bench.CHUNK), "--shares", "0,0.5,1", "--repeats", "1",
                       "--moments", moments, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["share"], r["part"]) for r in rows] == [(0.0, "cpu"), (0.5, "cpu"), (0.5, "streamed"), (0.5, "both"),
                                                       (1.0, "streamed")]
    assert all(r["s"] > 0 and r["host_gb_s"] > 0 for r in rows)
