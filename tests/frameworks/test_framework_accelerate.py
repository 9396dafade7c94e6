# accelerate with both offload modes: Accelerator(cpu=True), prepare(model,
# optimizer, loader, scheduler), a plain loop with accelerator.backward under
# accelerator.accumulate, on a tiny Llama built from a config (CPU, nothing
# downloaded). The default mode gives bit-identical losses to plain
# torch.optim.AdamW; full offload stays within bf16 noise of Bf16MasterAdamW.
# Skipped, with the reason shown, when accelerate is not installed.

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import cpu_offload  # noqa: E402
from helpers import (  # noqa: E402
    FullOffloadMaker, BF16_LOSS_ATOL, Bf16MasterAdamW, adamw, assert_trains, framework_clipping_and_option,
    loss_report, tiny_llama, token_rows,
)



def train_accelerate(make_opt, *, n_rows, grad_accum, clip):
    """One epoch over ``n_rows`` rows in batches of 2; returns (losses, model, prepared optimizer)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
    model = tiny_llama()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    loader = torch.utils.data.DataLoader(token_rows(n_rows), batch_size=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(3))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    losses = []
    for tokens in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, model, opt


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_accelerate_default_mode_bit_identical_to_adamw(grad_accum):
    n_rows = 40 if grad_accum == 1 else 42  # 21 micro-batches: the last window is short
    want, ref_model, ref_opt = train_accelerate(lambda m: adamw(m.parameters()), n_rows=n_rows,
                                                grad_accum=grad_accum, clip=True)
    got, model, opt = train_accelerate(lambda m: cpu_offload.offload_optimizer(adamw(m.parameters())),
                                       n_rows=n_rows, grad_accum=grad_accum, clip=True)
    diff, line = loss_report(f"accelerate offload='optimizer' grad_accum={grad_accum} vs AdamW", got, want)
    assert len(got) == n_rows // 2
    assert got == want, line
    assert_trains(got, line)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    # prepare() round-tripped load_state_dict(state_dict()): one list of groups for all
    wrapper = opt.optimizer
    assert isinstance(wrapper, cpu_offload.StateOffloadOptimizer)
    assert opt.param_groups is wrapper.param_groups is wrapper.optimizer.param_groups
    assert wrapper.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("n_rows", [80, 82])
def test_accelerate_full_offload_within_bf16_noise(n_rows):
    want, _, _ = train_accelerate(lambda m: Bf16MasterAdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                            weight_decay=0.1),
                                  n_rows=n_rows, grad_accum=2, clip=False)
    make = FullOffloadMaker(grad_accum_steps=2)
    try:
        got, _, _ = train_accelerate(make, n_rows=n_rows, grad_accum=2, clip=False)
    finally:
        make.close()
    diff, line = loss_report("accelerate offload='full' grad_accum=2 vs bf16 reference", got, want)
    assert len(got) == n_rows // 2  # one loss per batch; 82 rows end on a short window
    assert diff < BF16_LOSS_ATOL, line
    assert_trains(got, line)


def test_accelerate_clip_grad_norm_clips_full_offload_like_the_option():
    """accelerator.clip_grad_norm_(model.parameters(), 1.0) over a full-offload optimizer
    (clipped through it by torch.nn.utils.clip_grad_norm_) equals the optimizer's own
    max_grad_norm loss for loss. Before, it saw no gradient and clipped nothing."""
    option, framework = framework_clipping_and_option(lambda make, clip: train_accelerate(make, n_rows=40, grad_accum=2, clip=clip)[0])
    assert framework == option
