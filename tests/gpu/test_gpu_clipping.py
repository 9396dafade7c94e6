# Clipping and the non-finite guard of full offload on CUDA (marked gpu), on the
# example's Llama-shaped model: 20 steps with clip_grad_norm_ (clipping on some
# steps, not on others) against torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW
# replayed on the captured gradients, with the gradient copy on the host and on the
# device; a NaN loss leaves the state bit-identical.
# Run: pytest -m gpu tests/gpu/test_gpu_clipping.py
import math
import pathlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
# NOTE: on the example's data the gradient norms of these steps run from about 0.7 to
# 20 (they grow as the model learns the data's permutation): CLIP clips about half.
STEPS, SEQ, CLIP = 20, 256, 4.0
LOSS_SCALES = [0.5, 2.0, 1.0, 3.0, 0.3, 1.5]


def example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_fsdp
    return train_fsdp


def setup(**options):
    import cpu_offload

    ex = example()
    cfg = ex.ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, ffn_dim=704, max_seq_len=SEQ)
    model = ex.build_model(cfg, torch.device("cuda"), fsdp=False, seed=0)
    init = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    grads = {}
    for n, p in model.named_parameters():  # registered before the wrapper's hooks: they run first
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().float().cpu()))
    adamw = torch.optim.AdamW(ex.param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    opt = cpu_offload.offload_optimizer(adamw, offload="full", **options)
    return ex, cfg, model, opt, init, grads


def loss_of(ex, cfg, model, step):
    inputs, targets = ex.synthetic_batch(step, 0, rank=0, world=1, batch_size=2, seq_len=SEQ,
                                         vocab_size=cfg.vocab_size, seed=0, device=torch.device("cuda"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("grad_copy", ["host", "device"])
def test_clipped_training_matches_torch(grad_copy):
    ex, cfg, model, opt, init, grads = setup(grad_copy=grad_copy)
    assert opt.grad_copy == grad_copy
    names = {id(p): n for n, p in model.named_parameters()}
    history, norms = [], []
    for s in range(STEPS):
        grads.clear()
        (loss_of(ex, cfg, model, s) * LOSS_SCALES[s % len(LOSS_SCALES)]).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        history.append(dict(grads))
    # NOTE: torch's own float32 reduction of a million-element gradient drifts by ~1e-5, so the
    # norm is checked against torch's function evaluated in float64 (the exact norm).
    exact = [float(torch.nn.utils.get_total_norm([g.double() for g in step.values()], 2.0)) for step in history]
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[names[id(p)]] for p in g["params"]]}
              for g in opt.param_groups]
    ref = torch.optim.AdamW(groups)
    ref_norms = []
    for step_grads in history:
        for n, p in params.items():
            p.grad = step_grads.get(n)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], CLIP)))
        ref.step()
    clipped = sum(n > CLIP for n in ref_norms)
    assert 3 <= clipped <= STEPS - 3, ref_norms
    for ours, theirs, want in zip(norms, ref_norms, exact):
        assert abs(ours - want) <= 1e-6 * want, dict(ours=ours, torch_float32=theirs, torch_float64=want)
        assert abs(theirs - want) <= 1e-4 * want
    # NOTE: a redone step restores the second moment by inverse arithmetic, whose float32 error
    # grows like 2^-24 * r^2, r the ratio of the speculative factor (the previous step's clip
    # coefficient) to the final one; the errors of successive redos decay with beta2. This
    # test's loss scales make r jump up to ~4, so the bound is that sum, at 4 ulps a step.
    coefs = [min(1.0, CLIP / (n + 1e-6)) for n in exact]
    ratios = [max(a / b, b / a) for a, b in zip([1.0] + coefs[:-1], coefs)]
    beta2 = opt.param_groups[0]["betas"][1]
    second_moment_bound = max(1e-5, 4 * 2.0 ** -24 * sum(beta2 ** (STEPS - 1 - s) * (1 + r * r)
                                                          for s, r in enumerate(ratios)))
    state = opt.state
    for p in model.parameters():
        n = names[id(p)]
        mine, theirs = state[p], ref.state[params[n]]
        for key, want in (("master", params[n].detach()), ("exp_avg", theirs["exp_avg"]),
                          ("exp_avg_sq", theirs["exp_avg_sq"])):
            got = mine[key].view(want.shape)
            bound = second_moment_bound if key == "exp_avg_sq" else 1e-5
            assert float((got - want).norm() / want.norm()) < bound, (n, key, bound)
        assert torch.equal(p.detach().cpu(), mine["master"].view(p.shape).to(torch.bfloat16)), n
    opt.close()


def test_nan_loss_leaves_the_state_bit_identical():
    ex, cfg, model, opt, init, grads = setup()
    for s in range(3):
        loss_of(ex, cfg, model, s).backward()
        opt.step()
        opt.zero_grad()
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    weights = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (loss_of(ex, cfg, model, 3) * math.nan).backward()
        opt.step()
    assert any("step skipped" in str(w.message) for w in caught)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, before[id(p)][k]), k
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
    assert opt.stats()["skipped_steps"] == 1
    opt.zero_grad()
    loss_of(ex, cfg, model, 4).backward()
    opt.step()
    assert not opt.stats()["skipped"] and all(torch.isfinite(st["master"]).all() for st in opt.state.values())
    opt.close()
