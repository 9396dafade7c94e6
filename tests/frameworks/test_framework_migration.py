# Checkpoint migration between plain torch AdamW and full offload, both ways:
# train with AdamW (fp32), load its state_dict into offload_optimizer(...,
# offload="full"), train, save, load that into a plain AdamW over the fp32
# masters, train. The losses must continue without a jump: within bf16 noise of
# the same three phases run with Bf16MasterAdamW in the middle one.
# Needs no framework (a small torch language model, random tokens).


import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_offload
from helpers import BF16_LOSS_ATOL, Bf16MasterAdamW, loss_report, through_torch_save, token_rows

HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 6  # per phase


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 128)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.mlp(h))


def model():
    torch.manual_seed(0)
    return TinyLM()


def lm_loss(m, tokens):
    logits = m(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(m):
    return lm_loss(m, token_rows(32, seed=999)).item()


def train(m, opt, first_step):
    losses = []
    for s in range(first_step, first_step + STEPS):
        loss = lm_loss(m, token_rows(8, seed=s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses



def to_plain_adamw(m, sd, groups):
    """docs/checkpoints.md's recipe: fp32 parameters from the masters, then the rest of the
    state (without the masters) into a plain AdamW over the same groups."""
    m.float()
    params = [p for g in groups for p in g["params"]]
    with torch.no_grad():
        for i, entry in sd["state"].items():
            params[i].copy_(entry["master"])
    opt = torch.optim.AdamW(groups, **HP)
    opt.load_state_dict({"param_groups": sd["param_groups"],
                         "state": {i: {k: v for k, v in e.items() if k not in ("master", "master_step")}
                                   for i, e in sd["state"].items()}})
    return opt


def test_plain_adamw_to_full_offload_and_back():
    # reference: AdamW, then the bf16 model with fp32 masters stepped by AdamW, then AdamW
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    want = train(ref, opt, 0)
    mid = Bf16MasterAdamW(ref.parameters(), **HP)
    mid.load_state_dict(through_torch_save(opt.state_dict()))
    want += train(ref, mid, STEPS)
    mid.close()
    with torch.no_grad():
        for p, master in zip(ref.parameters(), mid.masters):
            p.data = master.clone()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    opt.load_state_dict(through_torch_save(mid.state_dict()))
    want += train(ref, opt, 2 * STEPS)

    m = model()
    opt = torch.optim.AdamW(m.parameters(), **HP)
    got = train(m, opt, 0)
    sd_plain = through_torch_save(opt.state_dict())
    fp32 = [p.detach().clone() for p in m.parameters()]
    boundary = [held_out_loss(m)]
    off = cpu_offload.offload_optimizer(torch.optim.AdamW(m.parameters(), **HP), offload="full")
    try:
        off.load_state_dict(sd_plain)
        boundary.append(held_out_loss(m))
        for p, w, (_i, entry) in zip(m.parameters(), fp32, sd_plain["state"].items()):
            st = off.state[p]
            assert torch.equal(st["master"], w) and p.dtype == torch.bfloat16
            assert torch.equal(st["exp_avg"], entry["exp_avg"]) and int(st["step"]) == STEPS
        got += train(m, off, STEPS)
        sd_full = through_torch_save(off.state_dict())
        groups = [{"params": list(g["params"])} for g in off.param_groups]
        boundary.append(held_out_loss(m))
    finally:
        off.close()
    opt = to_plain_adamw(m, sd_full, groups)
    boundary.append(held_out_loss(m))
    for p, entry in zip(m.parameters(), sd_full["state"].values()):
        assert torch.equal(p, entry["master"]) and p.dtype == torch.float32
        assert torch.equal(opt.state[p]["exp_avg_sq"], entry["exp_avg_sq"])
    got += train(m, opt, 2 * STEPS)

    diff, line = loss_report("AdamW -> full offload -> AdamW vs AdamW -> bf16 reference -> AdamW", got, want)
    assert got[:STEPS] == want[:STEPS], line  # the same plain AdamW phase
    assert diff < BF16_LOSS_ATOL, line
    # the same weights before and after each migration (bf16 rounding aside): no jump
    jumps = [abs(boundary[1] - boundary[0]), abs(boundary[3] - boundary[2])]
    print(f"held-out loss across the migrations: {boundary}, jumps {jumps}")
    assert max(jumps) < BF16_LOSS_ATOL, f"held-out loss jumps {jumps} at the migrations; {line}"
    assert sum(got[-3:]) / 3 < sum(got[:3]) / 3 - 0.1, line
