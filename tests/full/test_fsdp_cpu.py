# Full offload under FSDP2 on the CPU: two or four gloo processes (started like
# torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_*) train a
# sharded model and must end with masters and compute copies bit-identical to
# one process training the same model unsharded, also with part of each rank's
# state on its "device" (gpu_state, here the CPU); a checkpoint saved with
# torch.distributed.checkpoint and loaded into a fresh model resumes
# bit-identically. With clipping, the norm is the global one on every rank, and
# a NaN gradient on one rank only skips the step on both. A trainer's loop with a
# varying number of micro-batches, a divide factor and clipping equals
# torch.optim.AdamW fed the same gradients. With overlap_forward (the hooks on FSDP2's
# groups), two processes equal one process without it. Weights edited outside the optimizer
# (in place, or by model.load_state_dict) reach the masters as without FSDP2. With gradient
# sync off on all but the last micro-batch (HF Trainer's and accelerate's accumulation), the
# window's reduce-scattered sum is stepped bit for bit as cpu_offload.reference steps it.
import os
import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from helpers import rank_main, records_of, run_ranks

STEPS, RESUME_AT, ACCUM = 4, 2, 2


def make_model():
    torch.manual_seed(0)
    # 33 and 5 rows: uneven shards (FSDP2 pads rank 0's shard)
    return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 32), nn.GELU(), nn.Linear(32, 5))


def make_opt(model):
    return torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3},
    ], lr=1e-2, betas=(0.9, 0.95))


def batch(step, micro):
    # The same batch on every rank: the reduce-scatter average of equal bf16
    # gradients is exact, so the sharded run must equal the unsharded one.
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + micro)).to(torch.bfloat16)


def train(model, opt, steps, clip=None):
    norms = []
    for s in steps:
        for m in range(ACCUM):
            model(batch(s, m)).float().pow(2).mean().backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    return norms


CLIP, NAN_STEP = 0.05, 2


def poison_backward(model, index):
    """Put a NaN into the first weight's (local) gradient in backward pass number ``index`` (from 0)."""
    seen = [0]

    def hook(p):
        if seen[0] == index:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.view(-1)[0] = float("nan")
        seen[0] += 1
    next(iter(model.parameters())).register_post_accumulate_grad_hook(hook)


def clip_worker(out_dir):
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _shard(make_model(), init_device_mesh("cpu", (dist.get_world_size(),)))
    if rank == 1:  # NaN on rank 1 only, in the last micro-batch of step NAN_STEP
        poison_backward(model, NAN_STEP * ACCUM + ACCUM - 1)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2)
    norms = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for s in range(STEPS):
            for m in range(ACCUM):
                model(batch(s, m)).float().pow(2).mean().backward()
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
            opt.zero_grad()
    sd = opt.state_dict()
    result = {"norms": norms, "skipped": opt.stats()["skipped_steps"],
              "masters": {i: e["master"].full_tensor() for i, e in sd["state"].items()},
              "steps": {i: int(e["step"]) for i, e in sd["state"].items()}}
    torch.save(result, os.path.join(out_dir, f"clip{rank}.pt"))
    opt.close()
    dist.destroy_process_group()


def single_rank_clip_worker(out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    model = _shard(make_model(), init_device_mesh("cpu", (1,)))
    reduced = []
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: reduced.append(1) or real(*args, **kwargs)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2)
    norms = train(model, opt, range(STEPS), clip=CLIP / 5)
    masters = {i: e["master"].full_tensor() for i, e in opt.state_dict()["state"].items()}
    torch.save({"norms": norms, "all_reduces": len(reduced), "masters": masters}, os.path.join(out_dir, "one.pt"))
    opt.close()
    dist.destroy_process_group()


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _shard(make_model(), mesh)
    gpu_state = int(os.environ["TEST_GPU_STATE"]) if os.environ.get("TEST_GPU_STATE") else None
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2,
                            gpu_state=gpu_state)
    train(model, opt, range(RESUME_AT))
    ckpt = os.path.join(out_dir, "ckpt")
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=ckpt)
    train(model, opt, range(RESUME_AT, STEPS))

    sd = opt.state_dict()
    entry = sd["state"][0]
    result = {
        "dtensor_state": type(entry["master"]).__name__ == "DTensor" and entry["exp_avg"].to_local().device.type == "cpu",
        "masters": {i: e["master"].full_tensor() for i, e in sd["state"].items()},
        "compute": {n: p.full_tensor() for n, p in model.named_parameters()},
        "local_masters": {i: e["master"].to_local().clone() for i, e in sd["state"].items()},
        "on_device": [r.on_device for r in records_of(opt)],
    }

    # Resume: a fresh sharded model and optimizer, loaded from the checkpoint.
    model2 = _shard(make_model(), mesh)
    opt2 = offload_optimizer(make_opt(model2), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2,
                             gpu_state=gpu_state)
    sd2 = opt2.state_dict()
    dcp.load({"optim": sd2}, checkpoint_id=ckpt)
    opt2.load_state_dict(sd2)
    train(model2, opt2, range(RESUME_AT, STEPS))
    result["resumed_equal"] = all(
        torch.equal(e["master"].to_local(), result["local_masters"][i]) for i, e in opt2.state_dict()["state"].items()
    )
    # Wrapping after FSDP2's first forward is refused with an explanation.
    model3 = _shard(make_model(), mesh)
    model3(batch(0, 0).float())
    try:
        offload_optimizer(make_opt(model3), offload="full")
        result["late_wrap_error"] = ""
    except RuntimeError as e:
        result["late_wrap_error"] = str(e)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    opt.close()
    opt2.close()
    dist.destroy_process_group()


WINDOWS = [1, 3, 2, 5]  # micro-batches per step


def window_loop(model, opt, announce=False):
    """The RL/SFT trainer's step: set the window, backward each micro-batch, divide, clip, step."""
    norms = []
    for s, count in enumerate(WINDOWS):
        opt.grad_accum_steps = count
        for m in range(count):
            model(batch(s, m)).float().pow(2).sum().backward()
        opt.scale_grads_(1.0 / (8 * count))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
    return norms


def window_worker(out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    model = _shard(make_model(), init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=max(WINDOWS), pinned_bytes=1 << 15,
                            num_slots=2)
    norms = window_loop(model, opt)
    sd = opt.state_dict()
    result = {"norms": norms, "state": {i: {k: v.full_tensor() for k, v in e.items() if k not in ("step", "master_step")}
                                        for i, e in sd["state"].items()}}
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out_dir, "windows.pt"))
    opt.close()
    dist.destroy_process_group()


def no_sync_worker(out_dir):
    """What HF Trainer and accelerate do under FSDP2: gradient sync off on all but the last
    micro-batch (under HSDP, the all-reduce across replicas only). FSDP2 then keeps the
    window's gradient until the last backward reduces it whole. The reference: the same bf16 model, sharded alike and
    driven alike, its reduce-scattered window gradient stepped by cpu_offload.reference on
    fp32 masters. Each rank's masters and compute copies must equal it bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer
    from cpu_offload.reference import adamw_reference_

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gpu_state = int(os.environ["TEST_GPU_STATE"]) if os.environ.get("TEST_GPU_STATE") else None
    if os.environ.get("TEST_HSDP"):
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(make_model(), mesh)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2,
                            gpu_state=gpu_state)
    ref = _shard(make_model().to(torch.bfloat16), mesh)
    ref_params = [p for g in make_opt(ref).param_groups for p in g["params"]]  # the optimizer's order
    groups = [(g, p) for g in opt.param_groups for p in g["params"]]
    masters = [e["master"].to_local().clone() for e in opt.state_dict()["state"].values()]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    start = [m.clone() for m in masters]
    for s in range(STEPS):
        for m in range(ACCUM):
            for net in (model, ref):
                if os.environ.get("TEST_HSDP"):
                    net.set_requires_all_reduce(m == ACCUM - 1)
                else:
                    net.set_requires_gradient_sync(m == ACCUM - 1)
                x = batch(s, m) * (1 + rank)  # other data on each rank: the reduce-scatter sums
                net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for (group, _), q, master, (exp_avg, exp_avg_sq) in zip(groups, ref_params, masters, moments):
                adamw_reference_(master, q.grad.to_local(), exp_avg, exp_avg_sq, s + 1, lr=group["lr"],
                                 beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                                 weight_decay=group["weight_decay"])
                q.to_local().copy_(master.to(torch.bfloat16))
                q.grad = None
    sd = opt.state_dict()["state"]
    result = {"equal": [torch.equal(e["master"].to_local(), master) for e, master in zip(sd.values(), masters)],
              "compute_equal": [torch.equal(p.to_local(), q.to_local()) for (_, p), q in zip(groups, ref_params)],
              "steps": [int(e["step"]) for e in sd.values()],
              "moved": [bool((master != m0).any()) for master, m0 in zip(masters, start) if m0.numel()]}
    torch.save(result, os.path.join(out_dir, f"no_sync{rank}.pt"))
    opt.close()
    dist.destroy_process_group()


def _run_workers(mode, tmp_path, world=2, gpu_state=None):
    run_ranks(__file__, [mode, str(tmp_path)], world, TEST_GPU_STATE="" if gpu_state is None else str(gpu_state))


# gpu_state=2400 bytes (150 elements at 16 B each, with accumulation): rank 0's shards hold,
# in the optimizer's order (weights, then biases), 144, 264, 64, 9, 8 and 2 elements; spread
# over the order, those within the budget's share of what was walked go on the device
@pytest.mark.parametrize("world, gpu_state", [(2, None), (4, 2400)])
def test_fsdp2_processes_equal_one_process(tmp_path, world, gpu_state):
    _run_workers("--worker", tmp_path, world, gpu_state)
    result = torch.load(tmp_path / "result.pt")
    assert result["on_device"] == ([False, False, True, True, True, True] if gpu_state else [False] * 6)
    assert result["dtensor_state"]  # DTensors over host shards
    assert result["resumed_equal"]  # DCP save / load resumes bit-identically
    assert "before the first forward" in result["late_wrap_error"]

    # One process, the same model unsharded, the same batches.
    from cpu_offload import offload_optimizer

    model = make_model()
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2)
    train(model, opt, range(STEPS))
    sd = opt.state_dict()
    for i, e in sd["state"].items():
        assert torch.equal(e["master"], result["masters"][i]), i
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), result["compute"][n]), n
    opt.close()


def test_fsdp2_clipping_and_nan_on_one_rank(tmp_path):
    import warnings

    from cpu_offload import offload_optimizer

    _run_workers("--clip-worker", tmp_path)
    ranks = [torch.load(tmp_path / f"clip{r}.pt") for r in range(2)]
    assert ranks[0]["norms"][:NAN_STEP] == ranks[1]["norms"][:NAN_STEP]  # the global norm, on every rank
    assert all(r["norms"][NAN_STEP] != r["norms"][NAN_STEP] for r in ranks)  # NaN on both ranks
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1  # rank 1's NaN skipped the step on both
    assert ranks[0]["steps"] == ranks[1]["steps"] == {i: STEPS - 1 for i in ranks[0]["steps"]}

    # One process, the same model unsharded, the same batches, the same step skipped.
    model = make_model()
    poison_backward(model, NAN_STEP * ACCUM + ACCUM - 1)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norms = train(model, opt, range(STEPS), clip=CLIP)
    assert opt.stats()["skipped_steps"] == 1
    for ours, theirs in zip(norms, ranks[0]["norms"]):
        assert ours == theirs or abs(ours - theirs) <= 1e-6 * ours or (ours != ours and theirs != theirs)
    assert min(n for n in norms if n == n) > CLIP  # every step clipped
    for i, e in opt.state_dict()["state"].items():
        # rank 0 rolled back what it had stepped before rank 1's NaN was known: within the rollback's bound
        torch.testing.assert_close(e["master"], ranks[0]["masters"][i], rtol=1e-6, atol=1e-7)
    opt.close()


def test_fsdp2_on_one_rank_clips_without_a_collective(tmp_path):
    # On one GPU the first NCCL collective sets up its communicator: at the end of backward,
    # where the device is fullest, it failed to allocate at 21B. One rank has nothing to reduce.
    from cpu_offload import offload_optimizer

    _run_workers("--single-rank-clip-worker", tmp_path, world=1)
    result = torch.load(tmp_path / "one.pt")
    assert result["all_reduces"] == 0
    model = make_model()
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2)
    assert train(model, opt, range(STEPS), clip=CLIP / 5) == result["norms"]
    assert min(result["norms"]) > CLIP / 5  # every step clipped
    for i, e in opt.state_dict()["state"].items():
        assert torch.equal(e["master"], result["masters"][i]), i
    opt.close()


def test_fsdp2_variable_windows_match_torch_adamw(tmp_path):
    from cpu_offload import offload_optimizer

    _run_workers("--window-worker", tmp_path)
    result = torch.load(tmp_path / "windows.pt")
    # The same gradients, captured in one process (the reduce-scatter average of equal
    # gradients is exact), replayed through torch: sum, divide, clip_grad_norm_, AdamW.
    model = make_model()
    captured = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: captured.append((p, p.grad.float().clone())))
    init = [p.detach().float().clone() for p in model.parameters()]
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=max(WINDOWS), pinned_bytes=1 << 15,
                            num_slots=2)
    window_loop(model, opt)
    opt.close()
    params = [torch.nn.Parameter(t) for t in init]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ref = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                              "params": [params[index[id(p)]] for p in g["params"]]} for g in opt.param_groups])
    norms, at = [], 0
    for count in WINDOWS:
        window = captured[at : at + count * len(params)]
        at += count * len(params)
        for p in params:
            p.grad = None
        for p, g in window:
            q = params[index[id(p)]]
            q.grad = g.clone() if q.grad is None else q.grad.add_(g)
        for q in params:
            q.grad.mul_(1.0 / (8 * count))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        ref.step()
    assert sum(n > CLIP for n in norms) >= 2  # clipping active
    for ours, theirs in zip(result["norms"], norms):
        assert abs(ours - theirs) <= 1e-6 * theirs
    order = [p for g in opt.param_groups for p in g["params"]]
    for i, entry in result["state"].items():
        q = params[index[id(order[i])]]
        for key, want in (("master", q.detach()), ("exp_avg", ref.state[q]["exp_avg"]),
                          ("exp_avg_sq", ref.state[q]["exp_avg_sq"])):
            got = entry[key]
            assert float((got - want).norm() / want.norm()) < 1e-5, (i, key)


@pytest.mark.parametrize("when", ["between steps", "between two passes"])
@pytest.mark.parametrize("edit", ["in_place", "load_state_dict"])
def test_weights_edited_outside_the_optimizer_win_under_fsdp2(gloo_group, edit, when):
    # NOTE: an in-place op on an FSDP2 parameter (a DTensor) runs on its local shard below
    # autograd, which leaves the shard's version counter as it was; the DTensor's moves.
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    def change(model):
        with torch.no_grad():
            if edit == "in_place":
                model[2].weight.mul_(0.5)
            else:
                model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})

    mesh = init_device_mesh("cpu", (1,))
    masters = {}
    for run in ("one process, not edited", "one process", "FSDP2"):
        model = make_model()
        if run == "FSDP2":
            model = _shard(model, mesh)
        opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15,
                                num_slots=2)
        train(model, opt, range(1))
        edited = run != "one process, not edited"
        if edited and when == "between steps":
            change(model)
        for m in range(ACCUM):  # step 1, edited after its first pass
            model(batch(1, m)).float().pow(2).mean().backward()
            if edited and when == "between two passes" and m == 0:
                change(model)
        opt.step()
        opt.zero_grad()
        train(model, opt, range(2, 3))
        masters[run] = [getattr(e["master"], "full_tensor", e["master"].clone)() for e in opt.state_dict()["state"].values()]
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(masters["FSDP2"], masters["one process"]))
    # model[2].weight, halved: the edit is in the masters (three steps of lr 1e-2 move it far less)
    assert float(masters["one process"][1].norm()) < 0.8 * float(masters["one process, not edited"][1].norm())


def _sharded_after_one_step(mesh):
    """The model sharded on ``mesh`` and its full-offload optimizer (windows of ACCUM passes),
    after one step."""
    from cpu_offload import offload_optimizer

    model = _shard(make_model(), mesh)
    opt = offload_optimizer(make_opt(model), offload="full", grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2)
    train(model, opt, range(1))
    return model, opt


def test_model_to_of_an_fsdp2_model_swaps_its_parameters_as_without_full_offload(gloo_group):
    """Module._apply swaps DTensor parameters (torch.utils.swap_tensors), which refuses a tensor
    that has a weak reference, and full offload's registry of owned parameters held one:
    model.to("cpu") of an FSDP2 model (a move to where it already is, as set-up code calls it)
    raised torch's "Couldn't swap Linear.weight". It now moves, and trains as if not called."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    masters = {}
    for run in ("not moved", "moved"):
        model, opt = _sharded_after_one_step(mesh)
        if run == "moved":
            model.to("cpu")
        train(model, opt, range(1, 3))
        masters[run] = [e["master"].full_tensor() for e in opt.state_dict()["state"].values()]
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(masters["moved"], masters["not moved"]))


def test_a_weight_edited_after_the_last_backward_raises_under_fsdp2(gloo_group):
    """FSDP2 moves only the DTensor's version counter on an in-place edit: step() still sees
    an edit made after the window's last backward had stepped the weight, and undoes it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    masters = {}
    for run in ("not edited", "edited"):
        model, opt = _sharded_after_one_step(mesh)
        for m in range(ACCUM):
            model(batch(1, m)).float().pow(2).mean().backward()
        if run == "edited":
            with torch.no_grad():
                model[2].weight.mul_(0.5)
            with pytest.raises(RuntimeError, match=r"\['param_groups\[0\]\[1\]'\] changed in place"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
        train(model, opt, range(2, 3))
        masters[run] = [e["master"].full_tensor() for e in opt.state_dict()["state"].values()]
        weights = [p.full_tensor() for group in opt.param_groups for p in group["params"]]  # the state's order
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(masters["edited"], masters["not edited"]))
    assert all(torch.equal(w, m.to(w.dtype).reshape(w.shape)) for w, m in zip(weights, masters["edited"]))


def overlap_loop(model, opt, steps=STEPS):
    for s in range(steps):
        model(batch(s, 0)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model(batch(steps, 0)).float()


def overlap_worker(out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    model = _shard(make_model(), init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = offload_optimizer(make_opt(model), offload="full", overlap_forward=model)
    out = overlap_loop(model, opt)
    sd = opt.state_dict()
    result = {"out": out.detach(), "masters": {i: e["master"].full_tensor() for i, e in sd["state"].items()},
              "compute": {n: p.full_tensor() for n, p in model.named_parameters()}}
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out_dir, "overlap.pt"))
    opt.close()
    dist.destroy_process_group()


def test_fsdp2_overlap_forward_equals_one_process_without(tmp_path):
    from cpu_offload import offload_optimizer

    _run_workers("--overlap-worker", tmp_path)
    result = torch.load(tmp_path / "overlap.pt")
    model = make_model()
    opt = offload_optimizer(make_opt(model), offload="full")
    assert torch.equal(overlap_loop(model, opt), result["out"])
    for i, e in opt.state_dict()["state"].items():
        assert torch.equal(e["master"], result["masters"][i]), i
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), result["compute"][n]), n
    opt.close()


# HSDP (4 ranks: 2 replicas of 2 shards) defers only the all-reduce across replicas
# (set_requires_all_reduce(False)), as HF Trainer does for replicated FSDP2 models
@pytest.mark.parametrize("world, hsdp, gpu_state", [(2, False, None), (2, False, 2400), (4, True, None)])
def test_fsdp2_gradient_sync_off_but_on_the_last_micro_batch_steps_the_window_exactly(tmp_path, world, hsdp,
                                                                                     gpu_state):
    run_ranks(__file__, ["--no-sync-worker", str(tmp_path)], world, TEST_HSDP="1" if hsdp else "",
              TEST_GPU_STATE="" if gpu_state is None else str(gpu_state))
    for rank in range(world):
        result = torch.load(tmp_path / f"no_sync{rank}.pt")
        assert all(result["equal"]) and all(result["compute_equal"]), (rank, result)
        assert result["steps"] == [STEPS] * 6 and all(result["moved"]), (rank, result)


@pytest.mark.parametrize("how", ["the norm kept", "the linears kept"])
def test_parameters_of_one_fsdp2_group_left_in_two_dtypes_are_refused_at_construction(gloo_group, how):
    """keep_fp32 for a LayerNorm inside a block's fully_shard (the usual layout) was accepted,
    then the first forward failed inside FSDP2 ("FSDP expects uniform original parameter
    dtype"), naming neither the option nor a remedy. Refused now before anything changes, with
    the remedy; the LayerNorm in a fully_shard of its own trains."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cpu_offload import offload_optimizer

    def build(norm_apart):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        mesh = init_device_mesh("cpu", (1,))
        if norm_apart:
            fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = build(norm_apart=False)
    options = (dict(keep_fp32=list(model[1].parameters())) if how == "the norm kept"
               else dict(keep_fp32=list(model[0].parameters()) + list(model[2].parameters())))
    with pytest.raises(ValueError, match=r"trainable parameters of one FSDP2 group would be left in two dtypes \(torch.bfloat16 "
                                         r"and torch.float32: param_groups\[0\]\[\d\] in torch.bfloat16, "
                                         r"param_groups\[0\]\[\d\] in torch.float32\).*give the parameters kept in "
                                         r"float32 \(keep_fp32\) a fully_shard of their own"):
        offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full", **options)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
    model = build(norm_apart=True)
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full",
                            keep_fp32=list(model[1].parameters()))
    try:
        model(torch.randn(4, 8).bfloat16()).float().sum().backward()
        opt.step()
        assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    finally:
        opt.close()
    # FSDP2 asks one dtype of a group's trainable parameters only: a frozen fp32 base in the
    # group (LoRA's layout) is accepted, and so is another FSDP2 model whose groups mix dtypes
    class FrozenBase(nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.head = nn.Linear(8, 8), nn.Linear(8, 2)
            self.base.requires_grad_(False)

        def forward(self, x):
            return self.head(self.base(x.to(self.base.weight.dtype)).to(self.head.weight.dtype))

    other = FrozenBase()
    other.requires_grad_(False)
    other.head.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(other, mesh=mesh)
    model = FrozenBase()
    fully_shard(model, mesh=mesh)
    opt = offload_optimizer(torch.optim.AdamW(model.head.parameters()), offload="full")
    try:
        model(torch.randn(4, 8)).float().sum().backward()
        opt.step()
        assert model.base.weight.dtype == torch.float32 and model.head.weight.dtype == torch.bfloat16
    finally:
        opt.close()


def _write_a_master_in_place(opt, model, through):
    """Halve model[2].weight's master in place, through the DTensor or its local shard, as the
    ranks' one DTensor op; returns the master's local shard as written."""
    master = opt.state_dict()["state"][1]["master"]
    with torch.no_grad():
        (master if through == "the DTensor" else master.to_local()).mul_(0.5)
    return master.to_local().clone()


def stale_master_worker(out_dir):
    """Two ranks clamp one master in place (the same DTensor op on each) below the larger of
    their shards' maxima, which changes one rank's shard only, then train on: that rank warns,
    and both take what they hold (a raise on one rank left the other in FSDP2's reduce-scatter)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    model, opt = _sharded_after_one_step(init_device_mesh("cpu", (dist.get_world_size(),)))
    master = opt.state_dict()["state"][1]["master"]
    maxima = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(maxima, master.to_local().max().reshape(()))
    with torch.no_grad():
        master.clamp_(max=float(min(maxima)))
    written = master.to_local().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(batch(1, 0)).float().pow(2).mean().backward()
    taken = torch.equal(model[2].weight.to_local(), written.to(torch.bfloat16))
    model(batch(1, 1)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    train(model, opt, range(2, 3))
    torch.save({"warned": any("written in place" in str(w.message) for w in caught), "taken": taken},
               os.path.join(out_dir, f"stale{dist.get_rank()}.pt"))
    opt.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("through", ["the DTensor", "its local shard"])
def test_a_master_written_in_place_under_fsdp2_is_taken_at_the_next_backward_with_a_warning(gloo_group, through):
    """Under FSDP2 the masters handed out are DTensors over the host shards: a write into one
    (or into its local shard) is seen at the next backward, which takes it into the weight's
    shard and warns (FSDP2 does not train on after a backward that raised); training goes on."""
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = _sharded_after_one_step(init_device_mesh("cpu", (1,)))
    try:
        w = model[2].weight
        with torch.inference_mode():  # NOTE: first handed out there (an evaluation's checkpoint), as torch allows
            opt.state_dict()
        written = _write_a_master_in_place(opt, model, through)
        assert not torch.equal(w.to_local(), written.to(w.dtype))
        with pytest.warns(RuntimeWarning, match=r"masters of \['param_groups\[0\]\[1\]'\].*written in place.*"
                                                r"This window's gradients"):
            model(batch(1, 0)).float().pow(2).mean().backward()
        assert torch.equal(opt.state[w]["master"].to_local(), written)
        assert torch.equal(w.to_local(), written.to(w.dtype))
        model(batch(1, 1)).float().pow(2).mean().backward()
        opt.step()
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    finally:
        opt.close()


def test_a_master_written_in_place_after_the_last_backward_under_fsdp2_is_kept_with_a_warning(gloo_group):
    """Under FSDP2, a master written in place between the window's last backward (whose step
    ran during it) and step() is kept, its weight's shard written from it, and step() warns
    instead of raising (a raise on some ranks would leave the others in a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = _sharded_after_one_step(init_device_mesh("cpu", (1,)))
    try:
        w = model[2].weight
        master = opt.state_dict()["state"][1]["master"]  # NOTE: taken before: reading it after backward raises
        for m in range(ACCUM):
            model(batch(1, m)).float().pow(2).mean().backward()
        with torch.no_grad():
            master.mul_(0.5)
        written = master.to_local().clone()
        with pytest.warns(RuntimeWarning, match=r"masters of \['param_groups\[0\]\[1\]'\].*written in place after "
                                                r"the window's last backward pass"):
            opt.step()
        opt.zero_grad()
        assert torch.equal(opt.state[w]["master"].to_local(), written)
        assert torch.equal(w.to_local(), written.to(w.dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # NOTE: nothing is stale, so nothing is said
            train(model, opt, range(2, 3))
    finally:
        opt.close()


def test_a_master_written_in_place_on_some_ranks_only_warns_there_without_a_hang(tmp_path):
    """One DTensor op that changes the shards of some ranks only: each rank takes what it holds
    and the one whose weight was stale warns; none raises (which left the other in a collective)."""
    run_ranks(__file__, ["--stale-master-worker", str(tmp_path)], 2, timeout_s=120)
    results = [torch.load(tmp_path / f"stale{rank}.pt") for rank in range(2)]
    assert all(r["taken"] for r in results)
    assert sorted(r["warned"] for r in results) == [False, True]


# Each case: rank 1's optimizer built with one setting other than rank 0's, and the words
# the error must show (the setting, then both ranks' values).
DIFFERING = {
    "lr": (dict(lr=1e-3), r"param_groups\[1\]\['lr'\] \(rank 0: 0\.003, rank 1: 0\.001\)"),
    "grad_accum_steps": (dict(grad_accum_steps=4), r"grad_accum_steps \(rank 0: 2, rank 1: 4\)"),
    "max_grad_norm": (dict(max_grad_norm=1.0), r"max_grad_norm \(rank 0: None, rank 1: 1\.0\)"),
    "skip_nonfinite": (dict(skip_nonfinite=False), r"skip_nonfinite \(rank 0: True, rank 1: False\)"),
    "state_dtype": (dict(state_dtype=torch.bfloat16),
                    r"state_dtype \(rank 0: 'torch.float32', rank 1: 'torch.bfloat16'\)"),
    "keep_fp32": (dict(keep_fp32="last layer"), r"keep_fp32 \(rank 0: \[\], rank 1: \['param_groups\[0\]\[2\]', "
                                                r"'param_groups\[1\]\[2\]'\]\)"),
    "parameters": (dict(params="the last bias in the first group"),
                   r"param_groups\[0\]'s parameters \(global shapes\) \(rank 0: \[\(33, 16\), \(32, 33\), \(5, 32\)\], "
                   r"rank 1: \[\(33, 16\), \(32, 33\), \(5, 32\), \(5,\)\]\)"),
}


def differing_settings_worker(out_dir):
    """Build the optimizer once per case of DIFFERING, rank 1 with its other setting, then once
    alike (which trains a step); each rank saves what each construction raised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    errors = {}
    for case in [*DIFFERING, "alike"]:
        other = dict(DIFFERING[case][0]) if case != "alike" and dist.get_rank() == 1 else {}
        model = _shard(make_model(), mesh)
        base = make_opt(model)
        if other.pop("params", None):
            base.param_groups[0]["params"].append(base.param_groups[1]["params"].pop())
        if "lr" in other:
            base.param_groups[1]["lr"] = other.pop("lr")
        if other.pop("keep_fp32", None):
            other["keep_fp32"] = list(model[4].parameters())
        options = dict(grad_accum_steps=ACCUM, pinned_bytes=1 << 15, num_slots=2) | other
        try:
            opt = offload_optimizer(base, offload="full", **options)
        except ValueError as e:
            errors[case] = str(e)
            continue
        errors[case] = None
        train(model, opt, range(1))
        opt.close()
    torch.save(errors, os.path.join(out_dir, f"settings{dist.get_rank()}.pt"))
    dist.destroy_process_group()


def test_settings_that_differ_between_ranks_are_refused_at_construction_on_every_rank(tmp_path):
    """Options, hyper-parameters or parameters that differ between the ranks sharding a model made
    the ranks wait in different collectives (clipping on one rank only), pair unrelated values in
    one, or step the shards of one model with different math, with no error. The construction now
    raises on every rank, naming the setting and each rank's value; alike settings train."""
    run_ranks(__file__, ["--differing-settings-worker", str(tmp_path)], 2, timeout_s=150)
    for rank in range(2):
        errors = torch.load(tmp_path / f"settings{rank}.pt")
        assert errors["alike"] is None
        for case, (_, shown) in DIFFERING.items():
            assert errors[case] is not None, (rank, case)
            assert re.search(shown, errors[case]), (rank, case, errors[case])
            assert "were given different settings" in errors[case]


WORKERS = {"--worker": worker, "--clip-worker": clip_worker, "--window-worker": window_worker,
           "--overlap-worker": overlap_worker, "--single-rank-clip-worker": single_rank_clip_worker,
           "--no-sync-worker": no_sync_worker, "--stale-master-worker": stale_master_worker,
           "--differing-settings-worker": differing_settings_worker}

if __name__ == "__main__" and sys.argv[1:2] and sys.argv[1] in WORKERS:
    rank_main(lambda: WORKERS[sys.argv[1]](sys.argv[2]))
