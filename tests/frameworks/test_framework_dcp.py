# torch.distributed.checkpoint's state-dict API over FSDP2 (what torchtitan and accelerate's
# FSDP2 checkpoints call): two gloo ranks train, save get_model_state_dict and
# get_optimizer_state_dict with dcp.save, train on; a fresh model and wrapper load the
# checkpoint with dcp.load and set_*_state_dict and train the same steps. Both offload modes
# must end bit-identical to the run that was not interrupted, full offload also when every
# step clips.
import os
import sys

import pytest
import torch
import torch.nn as nn

from helpers import rank_main, run_ranks

OPTIONS = {
    "optimizer": {},
    "full": dict(pinned_bytes=1 << 15, num_slots=2),
    "full, clipped": dict(pinned_bytes=1 << 15, num_slots=2, max_grad_norm=0.05),
}


def resume_worker(out_dir: str, config: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cpu_offload import offload_optimizer

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mode = config.split(",")[0]

    def build():
        torch.manual_seed(0)
        # 33 and 5 rows: uneven shards
        model = nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 32), nn.GELU(), nn.Linear(32, 5))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        return model, offload_optimizer(opt, offload=mode, **OPTIONS[config])

    def train(model, opt, steps):
        for s in steps:
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * s + dist.get_rank()))
            model(x.to(torch.bfloat16) if mode == "full" else x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    def snapshot(model, opt):
        sd = opt.state_dict()["state"]
        return ([p.full_tensor().clone() for p in model.parameters()],
                [{k: v.full_tensor().clone() if hasattr(v, "full_tensor") else torch.as_tensor(v).clone()
                  for k, v in sd[i].items()} for i in sorted(sd)])

    model, opt = build()
    train(model, opt, [0, 1])
    ckpt = os.path.join(out_dir, "ckpt")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    train(model, opt, [2, 3])
    want = snapshot(model, opt)

    model2, opt2 = build()
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    train(model2, opt2, [2, 3])
    got = snapshot(model2, opt2)
    if dist.get_rank() == 0:
        torch.save({"want": want, "got": got}, os.path.join(out_dir, "result.pt"))
    for o in (opt, opt2):
        if mode == "full":
            o.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("config", list(OPTIONS))
def test_a_resume_through_the_dcp_state_dict_api_is_bit_identical(tmp_path, config):
    run_ranks(__file__, [str(tmp_path), config], world=2, timeout_s=150)
    result = torch.load(tmp_path / "result.pt")
    (want_weights, want_state), (got_weights, got_state) = result["want"], result["got"]
    for a, b in zip(want_weights, got_weights):
        assert torch.equal(a, b)
    assert len(want_state) == len(got_state) == 6
    for i, (a, b) in enumerate(zip(want_state, got_state)):
        assert a.keys() == b.keys() and int(a["step"]) == 4, i
        for key in a:
            assert torch.equal(a[key], b[key]), (i, key)


if __name__ == "__main__" and len(sys.argv) == 3:
    rank_main(lambda: resume_worker(sys.argv[1], sys.argv[2]))
