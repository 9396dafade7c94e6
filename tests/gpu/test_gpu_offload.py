# Full offload on CUDA (marked gpu, skipped without CUDA): pinned rings, side
# streams and events for real.
#   - equivalence on one GPU, plain module and FSDP2 (world size 1): masters
#     equal the reference replayed on the captured gradients (bit-exact) and
#     torch.optim.AdamW (float32 rounding);
#   - 100 steps without growth of GPU or pinned memory;
#   - peak GPU memory during training <= 25% of offload="none" (batch 1 x 128);
#   - two GPUs, FSDP2 under torchrun: every rank's shards equal the reference,
#     and the gathered masters equal a one-GPU run of the same model and data.
# Run: pytest -m gpu tests/gpu/test_gpu_offload.py   (the 2-GPU test starts torchrun
# itself; by hand: PYTHONPATH=tests torchrun --nproc-per-node 2 tests/gpu/test_gpu_offload.py --worker DIR)
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import cpu_offload
from helpers import LM, LM_TOKENS, capture_local_grads, free_port, loss_fn, make_opt, records_of, shard_blocks, tokens
from cpu_offload import offload_optimizer
from cpu_offload.reference import adamw_reference_

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

def check_against_reference(model, opt, init, history):
    """Replay the captured gradients on fp32 copies: reference (exact), torch AdamW (close)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    group_of = {by_id[id(p)]: g for g in opt.param_groups for p in g["params"]}
    ref = {n: init[n].clone() for n in init}
    m = {n: torch.zeros_like(t) for n, t in ref.items()}
    v = {n: torch.zeros_like(t) for n, t in ref.items()}
    tp = {n: nn.Parameter(t.clone()) for n, t in ref.items()}
    topt = torch.optim.AdamW([{"params": [tp[by_id[id(p)]] for p in g["params"]],
                               **{k: x for k, x in g.items() if k not in ("params", "param_names")}}
                              for g in opt.param_groups])
    for step, grads in enumerate(history, 1):
        for n in ref:
            total = grads[n][0].clone()
            for g in grads[n][1:]:
                total += g
            grp = group_of[n]
            adamw_reference_(ref[n], total, m[n], v[n], step, lr=grp["lr"], beta1=grp["betas"][0],
                             beta2=grp["betas"][1], eps=grp["eps"], weight_decay=grp["weight_decay"])
            tp[n].grad = total
        topt.step()
    sd = opt.state_dict()
    for rec in records_of(opt):
        n = by_id[id(rec.param)]
        master = rec.master.view(rec.shape)
        assert torch.equal(master, ref[n]), n
        torch.testing.assert_close(master, tp[n].detach(), rtol=1e-5, atol=1e-6, msg=n)
        local = rec.local().detach().cpu()
        assert torch.equal(local, master.to(torch.bfloat16)), n  # GPU compute copy = round(master)
        assert sd["state"][rec.index]["step"].item() == len(history)


def train(model, opt, steps, accum=1, history=None, grads=None):
    for s in steps:
        if grads is not None:
            grads.clear()
        for micro in range(accum):
            loss_fn(model, tokens(s, micro)).backward()
        opt.step()
        opt.zero_grad()
        if history is not None:
            history.append({n: list(g) for n, g in grads.items()})


@pytest.mark.parametrize("accum", [1, 2])
def test_single_gpu_plain_equivalence(accum):
    torch.manual_seed(0)
    model = LM().cuda()
    init = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    grads = capture_local_grads(model)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=accum, pinned_bytes=1 << 21)
    history = []
    train(model, opt, range(5), accum, history, grads)
    assert opt.stats()["chunks"] > 1 and all(p.grad is None for p in model.parameters())
    check_against_reference(model, opt, init, history)
    opt.close()


def test_single_gpu_fsdp2_equivalence(single_rank_group):
    torch.manual_seed(0)
    model = shard_blocks(LM().cuda())
    init = {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}
    grads = capture_local_grads(model)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=2, pinned_bytes=1 << 21)
    history = []
    train(model, opt, range(4), 2, history, grads)
    assert type(opt.state_dict()["state"][0]["master"]).__name__ == "DTensor"
    check_against_reference(model, opt, init, history)
    opt.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_single_gpu_weight_edits_inside_a_window(overlap):
    """On the GPU's copy path: an edit between two backwards of a window is the weight the step
    updates (bit for bit against the reference), and an edit after the last backward, whose
    update already ran, is undone by step(), which raises; training goes on exactly."""
    torch.manual_seed(0)
    model = LM().cuda()
    grads = capture_local_grads(model)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=2, pinned_bytes=1 << 21,
                            overlap_forward=model if overlap else None)
    train(model, opt, range(2), 2, None, grads)
    opt.wait_for_weights()
    head, states = model.head.weight, {}
    for r in records_of(opt):
        states[id(r.param)] = (r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone(), r.step)
    grads.clear()
    loss_fn(model, tokens(2, 0)).backward()
    with torch.no_grad():
        head.mul_(0.5)  # between the two backwards: the step updates it
    edited = head.detach().float().cpu().reshape(-1)
    loss_fn(model, tokens(2, 1)).backward()
    opt.step()
    opt.zero_grad()
    opt.wait_for_weights()
    by_id = {id(p): n for n, p in model.named_parameters()}
    for rec in records_of(opt):
        n, grp = by_id[id(rec.param)], opt.param_groups[rec.group]
        want, exp_avg, exp_avg_sq, step = states[id(rec.param)]
        if n == "head.weight":
            want = edited.clone()
        adamw_reference_(want, (grads[n][0] + grads[n][1]).reshape(-1), exp_avg, exp_avg_sq, step + 1, lr=grp["lr"],
                         beta1=grp["betas"][0], beta2=grp["betas"][1], eps=grp["eps"], weight_decay=grp["weight_decay"])
        assert torch.equal(rec.master, want) and torch.equal(rec.local().detach().cpu().reshape(-1),
                                                             want.to(torch.bfloat16)), n
    masters = {n: r.master.clone() for n, r in ((by_id[id(r.param)], r) for r in records_of(opt))}
    for micro in range(2):
        loss_fn(model, tokens(3, micro)).backward()
    opt.wait_for_weights()
    with torch.no_grad():
        head.mul_(0.5)  # after the last backward: undone, and step() raises
    with pytest.raises(RuntimeError, match="changed in place after the window's last backward"):
        opt.step()
    opt.zero_grad()
    opt.wait_for_weights()
    for rec in records_of(opt):
        n = by_id[id(rec.param)]
        assert not torch.equal(rec.master, masters[n]), n  # stepped
        assert torch.equal(rec.local().detach().cpu().reshape(-1), rec.master.to(torch.bfloat16)), n
    train(model, opt, range(4, 6), 2)
    opt.close()


def _pinned_bytes():
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0))


@pytest.mark.parametrize("fsdp", [False, True])
def test_hundred_steps_no_memory_growth(fsdp, request):
    if fsdp:
        request.getfixturevalue("single_rank_group")
    torch.manual_seed(0)
    model = LM().cuda()
    if fsdp:
        model = shard_blocks(model)
    opt = offload_optimizer(make_opt(model), offload="full", pinned_bytes=1 << 22)
    after, peaks = [], []
    for s in range(100):
        if s in (5, 10):
            torch.cuda.reset_peak_memory_stats()
        loss_fn(model, tokens(s)).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if s == 9:
            peaks.append(torch.cuda.max_memory_allocated())  # steps 5..9
        if s >= 9:
            after.append((torch.cuda.memory_allocated(), _pinned_bytes(), opt.stats()["pinned_bytes"]))
    peaks.append(torch.cuda.max_memory_allocated())  # steps 10..99
    assert len({a[0] for a in after}) == 1, f"GPU memory after step() changed: {sorted({a[0] for a in after})}"
    assert len({a[1] for a in after}) == 1 and len({a[2] for a in after}) == 1, "pinned memory changed"
    assert peaks[1] <= 1.05 * peaks[0] + (8 << 20), f"peak GPU memory grew: {peaks}"
    opt.close()


def _peak(offload, **options):
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = LM(d=1536, blocks=6, vocab=32768).cuda()
    opt = offload_optimizer(make_opt(model), offload=offload, **options)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for s in range(3):
        t = torch.randint(0, 32768, (1, LM_TOKENS), generator=torch.Generator().manual_seed(s)).cuda()
        loss_fn(model, t).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if offload == "full":
        opt.close()
    del model, opt
    return peak


def test_peak_memory_is_a_quarter_of_no_offload():
    # A model whose parameters dominate memory (batch 1 x 128 tokens): full offload keeps the
    # 2 B bf16 compute copy per parameter, plus with grad_copy="device" (the default) the step's
    # 2 B bf16 gradients until the window closes; grad_copy="host" keeps those in host RAM.
    none = _peak("none")
    host = _peak("full", grad_copy="host")
    device = _peak("full")
    n_params = sum(p.numel() for p in LM(d=1536, blocks=6, vocab=32768).parameters())
    print(f"peak GPU memory: offload='none' {none / 2**20:.0f} MiB, offload='full' {host / 2**20:.0f} MiB "
          f"({100 * host / none:.1f}%) with grad_copy='host', {device / 2**20:.0f} MiB with 'device'")
    assert host <= 0.25 * none
    assert device <= host + 2 * n_params + (64 << 20)


def test_state_offload_keeps_moments_in_pinned_host_memory():
    torch.manual_seed(0)
    a = LM().cuda()
    b = LM().cuda()
    b.load_state_dict(a.state_dict())
    plain = make_opt(a)
    wrapped = offload_optimizer(make_opt(b), offload="optimizer")
    for s in range(3):
        for model, opt in ((a, plain), (b, wrapped)):
            loss_fn(model, tokens(s)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # works: grads stay on the GPU
            opt.step()
            opt.zero_grad()
    for p in b.parameters():
        st = wrapped.state[p]
        assert st["exp_avg"].device.type == "cpu" and st["exp_avg"].is_pinned()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- two GPUs

def worker(out_dir):
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = shard_blocks(LM().cuda())
    init = {n: p.to_local().detach().float().cpu() for n, p in model.named_parameters()}
    grads = capture_local_grads(model)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=2, pinned_bytes=1 << 21)
    history = []
    train(model, opt, range(4), 2, history, grads)  # the same tokens on both ranks
    check_against_reference(model, opt, init, history)  # on this rank's shards
    # NOTE: the state's DTensors hold CPU shards; an NCCL-only group cannot
    # gather them (full_tensor() needs a CPU backend), so each rank saves its own.
    local = {i: e["master"].to_local().clone() for i, e in opt.state_dict()["state"].items()}
    torch.save(local, os.path.join(out_dir, f"masters{rank}.pt"))
    opt.close()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_fsdp2_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           __file__, "--worker", str(tmp_path)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(cpu_offload.__file__)))  # the workers import it too
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # and tests/helpers.py
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, tests] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    shards = [torch.load(tmp_path / f"masters{r}.pt") for r in range(2)]
    masters = {i: torch.cat([s[i] for s in shards]) for i in shards[0]}  # FSDP2 shards dim 0 in rank order
    torch.manual_seed(0)
    model = LM().cuda()
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=2, pinned_bytes=1 << 21)
    train(model, opt, range(4), 2)
    for i, e in opt.state_dict()["state"].items():
        torch.testing.assert_close(e["master"], masters[i], rtol=1e-5, atol=1e-6, msg=str(i))
    opt.close()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])


def test_a_zero_gradient_that_zero_grad_keeps_is_stepped_on_the_gpu_as_torch():
    """With zero_grad(set_to_none=False) torch steps a parameter that got no gradient in a
    window on the zeros it kept; full offload stages such zeros from the host, and the norm
    tracking (on by default) called record_stream on that host tensor, which raised
    NotImplementedError at the end of the window's backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).cuda()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), offload="full")
    try:
        for s in range(4):
            before = opt.state[model[1].weight]["master"].clone()
            y = model[0](torch.randn(8, 16, device="cuda").bfloat16())
            if s % 2 == 0:  # the second layer only on even steps
                y = model[1](y)
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            assert not torch.equal(opt.state[model[1].weight]["master"], before), s  # stepped, also on zeros
        assert int(opt.state[model[1].weight]["step"]) == 4
    finally:
        opt.close()
