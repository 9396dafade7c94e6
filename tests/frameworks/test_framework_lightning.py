# Lightning with both offload modes: a LightningModule whose
# configure_optimizers returns the wrapper (and an LR scheduler), trained by
# Trainer(accelerator="cpu", max_steps=20) on a tiny Llama built from a config
# (nothing downloaded). The default mode gives bit-identical losses to plain
# torch.optim.AdamW, with clipping and a short last accumulation window; full
# offload stays within bf16 noise of Bf16MasterAdamW; a second fit() reuses the wrapper
# built once, and a second wrapper is refused saying so. Skipped, with the reason shown,
# when lightning is not installed.

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

import cpu_offload  # noqa: E402
from helpers import (  # noqa: E402
    FullOffloadMaker, BF16_LOSS_ATOL, Bf16MasterAdamW, adamw, assert_trains, framework_clipping_and_option,
    loss_report, tiny_llama, token_rows,
)

# NOTE: a deprecation inside the framework itself, not in these tests or this package.
pytestmark = pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated")


class TinyLM(L.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        self.model = tiny_llama()
        self.make_opt = make_opt
        self.losses = []

    def training_step(self, tokens, batch_idx):
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        self.opt = self.make_opt(self.model)
        sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train_lightning(make_opt, *, n_rows, grad_accum, clip, precision="32-true"):
    module = TinyLM(make_opt)
    loader = torch.utils.data.DataLoader(token_rows(n_rows), batch_size=2, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=20, max_epochs=100, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=grad_accum, gradient_clip_val=1.0 if clip else None,
                        precision=precision)
    trainer.fit(module, loader)
    return module.losses, module


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_lightning_default_mode_bit_identical_to_adamw(grad_accum):
    # 14 rows / batch 2 = 7 batches an epoch: with accumulation 2 each epoch ends on a short window
    n_rows = 40 if grad_accum == 1 else 14
    want, ref = train_lightning(lambda m: adamw(m.parameters()), n_rows=n_rows, grad_accum=grad_accum, clip=True)
    got, mod = train_lightning(lambda m: cpu_offload.offload_optimizer(adamw(m.parameters())),
                               n_rows=n_rows, grad_accum=grad_accum, clip=True)
    diff, line = loss_report(f"Lightning offload='optimizer' grad_accum={grad_accum} vs AdamW", got, want)
    assert len(got) == (20 if grad_accum == 1 else 35)  # 20 steps: 5 epochs of 4 windows (2, 2, 2, 1)
    assert got == want, line
    assert_trains(got, line)
    for a, b in zip(mod.model.parameters(), ref.model.parameters()):
        assert torch.equal(a, b)
    assert mod.opt.optimizer.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"] == 1e-2


def test_lightning_full_offload_within_bf16_noise():
    n_rows = 40  # every window full: Lightning, like Trainer, steps a short last window
    want, _ = train_lightning(lambda m: Bf16MasterAdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                        weight_decay=0.1),
                              n_rows=n_rows, grad_accum=2, clip=False)
    make = FullOffloadMaker(grad_accum_steps=2)
    try:
        got, mod = train_lightning(make, n_rows=n_rows, grad_accum=2, clip=False)
        # fp32 weights to save: the masters in the optimizer's state_dict
        masters = [entry["master"] for entry in mod.opt.state_dict()["state"].values()]
        for p, m in zip(mod.model.parameters(), masters):
            assert m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))
    finally:
        make.close()
    diff, line = loss_report("Lightning offload='full' grad_accum=2 vs bf16 reference", got, want)
    assert len(got) == 40
    assert diff < BF16_LOSS_ATOL, line
    assert_trains(got, line)


def test_lightning_gradient_clip_val_clips_full_offload_like_the_option():
    """Lightning's gradient_clip_val over a full-offload optimizer (clipped through it by
    torch.nn.utils.clip_grad_norm_) equals the optimizer's own max_grad_norm loss for loss.
    Before, Lightning's clipping saw no gradient and clipped nothing, without a word."""
    option, framework = framework_clipping_and_option(lambda make, clip: train_lightning(make, n_rows=40, grad_accum=2, clip=clip)[0])
    assert framework == option


def test_lightning_bf16_mixed_gradient_clip_val_clips_full_offload_like_the_option():
    """Lightning's bf16-mixed precision refuses to clip an optimizer whose step unscales its own
    gradients (``_step_supports_amp_scaling``): a class attribute that full offload set for
    torch's GradScaler broke this recipe. It clips as the option does."""
    option, framework = framework_clipping_and_option(
        lambda make, clip: train_lightning(make, n_rows=40, grad_accum=2, clip=clip, precision="bf16-mixed")[0])
    assert framework == option


def fit_twice(module, *, steps=4):
    loader = torch.utils.data.DataLoader(token_rows(16), batch_size=2, shuffle=False)
    for _ in range(2):
        L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, loader)


def test_a_second_fit_of_a_full_offload_module_reuses_its_wrapper_or_says_how_to():
    # Lightning calls configure_optimizers on every fit(): a new wrapper over the parameters the
    # first one still drives (its fp32 masters hold their values) is refused, saying to reuse it
    make, once = FullOffloadMaker(grad_accum_steps=1), FullOffloadMaker(grad_accum_steps=1)
    try:
        with pytest.raises(RuntimeError, match="Lightning calls configure_optimizers on every fit"):
            fit_twice(TinyLM(make))
        module = TinyLM(lambda m: once.made[0] if once.made else once(m))  # the docs' recipe: build it once
        fit_twice(module)
        assert len(once.made) == 1 and {int(e["step"]) for e in module.opt.state.values()} == {8}
    finally:
        make.close()
        once.close()


def test_ema_weights_that_lightning_copies_in_through_data_reach_the_masters_by_the_docs_recipe():
    """Lightning's ``EMAWeightAveraging`` copies the averaged weights into the model at the end of
    ``fit()`` through ``p.data.copy_``, which moves no version counter, so full offload does not
    see it: the masters kept the trained weights, and a next step updated those while its
    gradient came from the averaged ones. docs/frameworks.md says so and gives the recipe that
    hands the model's weights to the masters; this checks both."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    once = FullOffloadMaker(grad_accum_steps=1)
    try:
        module = TinyLM(lambda m: once.made[0] if once.made else once(m))
        loader = torch.utils.data.DataLoader(token_rows(16), batch_size=2, shuffle=False)
        L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[EMAWeightAveraging(decay=0.5)]).fit(module, loader)
        opt = module.opt
        unseen = [p for p, entry in opt.state.items() if not torch.equal(entry["master"], p.detach().float())]
        assert unseen  # the limitation the docs state
        for p, entry in opt.state.items():  # the docs' recipe
            entry["master"] = p.detach()
        for p, entry in opt.state.items():
            assert torch.equal(entry["master"], p.detach().float())
    finally:
        once.close()


class ValidatedLM(TinyLM):
    def validation_step(self, tokens, batch_idx):
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss)


def test_a_checkpoint_after_validation_in_the_middle_of_a_window_saves_the_last_steps_state(tmp_path):
    """Validation every 3 batches with accumulation 2 lands in the middle of a window, and
    ModelCheckpoint(monitor="val_loss") saves right after it: the optimizer's state_dict() there
    was refused, and training stopped. It is the state of the last step, as torch's."""
    make = FullOffloadMaker(grad_accum_steps=2)
    try:
        module = ValidatedLM(make)
        saved_steps = []

        class Steps(L.Callback):
            def on_save_checkpoint(self, trainer, pl_module, checkpoint):
                state = checkpoint["optimizer_states"][0]["state"]
                saved_steps.append((trainer.global_step, {int(e["step"]) for e in state.values()}))

        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, accumulate_grad_batches=2, val_check_interval=3,
                            num_sanity_val_steps=0, callbacks=[
                                L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="val_loss",
                                                                    save_top_k=-1), Steps()])
        trainer.fit(module, torch.utils.data.DataLoader(token_rows(14), batch_size=2),
                    torch.utils.data.DataLoader(token_rows(4), batch_size=2))
    finally:
        make.close()
    # batches 3 and 6 of each epoch of 7: after 1 step and a half window, after 3 steps
    assert [s for s, _ in saved_steps][:2] == [1, 3], saved_steps
    assert all(steps == {global_step} for global_step, steps in saved_steps), saved_steps
