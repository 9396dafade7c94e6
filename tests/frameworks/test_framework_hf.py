# HF Trainer and TRL's SFTTrainer with both offload modes, on a tiny Llama built
# from a config and random token rows (CPU, nothing downloaded).
#
# The default mode must log bit-identical losses to plain torch.optim.AdamW,
# also across a short last gradient-accumulation window; full offload must stay
# within bf16 noise of Bf16MasterAdamW (bf16 model, fp32 masters, plain AdamW),
# also when it clips (the Trainer's clipping off, the optimizer's max_grad_norm on).
# Skipped, with the reason shown, when transformers (or trl) is not installed.

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cpu_offload  # noqa: E402
from cpu_offload._full.protocol import Phase  # noqa: E402
from helpers import (  # noqa: E402
    FullOffloadMaker, BF16_LOSS_ATOL, Bf16MasterAdamW, adamw, assert_trains, loss_report, phase_of, tiny_llama,
    token_rows,
)


def rows(n):
    return [{"input_ids": r, "labels": r.clone()} for r in token_rows(n)]


def train_with_trainer(tmp_path, make_opt, *, n_rows, grad_accum, epochs=1, **extra_args):
    """Train through transformers.Trainer; return (logged losses, model, optimizer)."""
    model = tiny_llama()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))  # warm-up
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
        num_train_epochs=epochs, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=7, dataloader_num_workers=0, **extra_args)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows(n_rows), optimizers=(opt, sched))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, model, opt


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_trainer_default_mode_bit_identical_to_adamw(tmp_path, grad_accum):
    # 42 rows / batch 2 = 21 micro-batches: with accumulation 2 the last window has one
    n_rows = 40 if grad_accum == 1 else 42
    want, ref_model, _ = train_with_trainer(tmp_path, lambda m: adamw(m.parameters()),
                                            n_rows=n_rows, grad_accum=grad_accum, max_grad_norm=1.0)
    got, model, opt = train_with_trainer(
        tmp_path, lambda m: cpu_offload.offload_optimizer(adamw(m.parameters())),
        n_rows=n_rows, grad_accum=grad_accum, max_grad_norm=1.0)
    diff, line = loss_report(f"Trainer offload='optimizer' grad_accum={grad_accum} vs AdamW", got, want)
    assert len(got) == (20 if grad_accum == 1 else 11)
    assert got == want, line
    assert_trains(got, line)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert isinstance(opt, cpu_offload.StateOffloadOptimizer)



# 40 rows / batch 2: every window of 2 is full; 42 rows: the last window of each epoch has 1
@pytest.mark.parametrize("n_rows", [40, 42])
def test_trainer_full_offload_within_bf16_noise(tmp_path, n_rows):
    want, _, _ = train_with_trainer(tmp_path, lambda m: Bf16MasterAdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                                        weight_decay=0.1),
                                    n_rows=n_rows, grad_accum=2, epochs=2, max_grad_norm=0.0)
    make = FullOffloadMaker(grad_accum_steps=2)
    try:
        got, model, opt = train_with_trainer(tmp_path, make, n_rows=n_rows, grad_accum=2, epochs=2,
                                             max_grad_norm=0.0)
        # the README's recipe: fp32 weights from the masters in the optimizer's state_dict
        sd = opt.state_dict()
        params = [p for group in opt.param_groups for p in group["params"]]
        name = {p: n for n, p in model.named_parameters()}
        fp32 = {name[params[i]]: entry["master"] for i, entry in sd["state"].items()}
        model.save_pretrained(tmp_path / "fp32", state_dict={**model.state_dict(), **fp32})
        loaded = dict(type(model).from_pretrained(tmp_path / "fp32", dtype=torch.float32).named_parameters())
        assert len(fp32) == len(loaded)
        for n, p in model.named_parameters():
            assert loaded[n].dtype == torch.float32 and torch.equal(loaded[n], fp32[n])
            assert p.dtype == torch.bfloat16 and torch.equal(p, fp32[n].to(torch.bfloat16))
    finally:
        make.close()
    diff, line = loss_report("Trainer offload='full' grad_accum=2 vs bf16 reference", got, want)
    assert len(got) == 2 * (n_rows // 4 + (n_rows % 4 > 0))  # 2 epochs of windows; 42 rows: a short last one
    assert diff < BF16_LOSS_ATOL, line
    assert_trains(got, line)


def test_trainer_full_offload_clips_like_torch(tmp_path):
    clip = 0.5  # below the tiny model's gradient norms (about 2.3): every step clips

    def reference(max_grad_norm):
        return lambda m: Bf16MasterAdamW(m.parameters(), max_grad_norm=max_grad_norm, lr=1e-2, betas=(0.9, 0.95),
                                         weight_decay=0.1)
    want, _, _ = train_with_trainer(tmp_path, reference(clip), n_rows=42, grad_accum=2, max_grad_norm=0.0)
    unclipped, _, _ = train_with_trainer(tmp_path, reference(None), n_rows=42, grad_accum=2, max_grad_norm=0.0)
    # the README's recipe: the Trainer's clipping off, the optimizer's on
    make = FullOffloadMaker(grad_accum_steps=2, max_grad_norm=clip)
    try:
        got, model, opt = train_with_trainer(tmp_path, make, n_rows=42, grad_accum=2, max_grad_norm=0.0)
        assert opt.stats()["clip_coef"] < 1 and opt.stats()["grad_norm"] > clip
    finally:
        make.close()
    diff, line = loss_report("Trainer offload='full' max_grad_norm vs torch's clip_grad_norm_", got, want)
    assert diff < BF16_LOSS_ATOL, line
    assert max(abs(a - b) for a, b in zip(unclipped, want)) > 2 * BF16_LOSS_ATOL  # clipping changed the run


def test_trainer_clipping_left_on_clips_full_offload_like_the_option(tmp_path):
    """The Trainer's own clipping (its default max_grad_norm=1.0; here 0.5) over a full-offload
    optimizer without max_grad_norm: torch.nn.utils.clip_grad_norm_, which the Trainer calls
    through accelerate, clips through the optimizer, so the run equals the recipe's (the
    Trainer's clipping off, the optimizer's on) loss for loss, and the logged norms are the
    real ones. Before, it saw no gradient: nothing was clipped and the Trainer logged 0."""
    clip, runs = 0.5, []
    for trainer_clip, option in ((0.0, clip), (clip, None)):
        make = FullOffloadMaker(grad_accum_steps=2, max_grad_norm=option)
        try:
            model = tiny_llama()
            opt = make(model)
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_grad_norm=trainer_clip, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=7, dataloader_num_workers=0)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=rows(40), optimizers=(opt, None))
            trainer.train()
            runs.append(trainer.state.log_history)
        finally:
            make.close()
    recipe, left_on = ([(e["loss"], e.get("grad_norm")) for e in log if "loss" in e] for log in runs)
    assert [loss for loss, _ in left_on] == [loss for loss, _ in recipe]
    assert all(norm > clip for _, norm in left_on), left_on


class StopAt(transformers.TrainerCallback):
    """Stops training once, after optimizer step ``at``: at that step's end, or (``mid_window``) after
    the next window's first micro-batch."""

    def __init__(self, at, mid_window):
        self.at, self.mid_window, self.done = at, mid_window, False

    def _stop(self, state, control, mid_window):
        if mid_window == self.mid_window and state.global_step == self.at and not self.done:
            self.done = control.should_training_stop = True

    def on_substep_end(self, args, state, control, **kwargs):
        self._stop(state, control, True)

    def on_step_end(self, args, state, control, **kwargs):
        self._stop(state, control, False)


def test_trainer_stopped_in_the_middle_of_a_window_then_trained_again_drops_that_window(tmp_path):
    # train() starts with model.zero_grad(): torch drops the stopped window's gradients, and so
    # must full offload, whose gradients are on the host.
    def run(mid_window):
        model = tiny_llama()
        opt = FullOffloadMaker(grad_accum_steps=2)(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=7,
            dataloader_num_workers=0, max_grad_norm=0.0, lr_scheduler_type="constant")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows(40), optimizers=(opt, None),
                                       callbacks=[StopAt(2, mid_window)])
        trainer.train()
        assert trainer.state.global_step == 2
        assert phase_of(opt) is (Phase.ACCUMULATING if mid_window else Phase.IDLE)
        trainer.train()  # from the start, on the same model and optimizer
        weights = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return weights

    start = [p.detach() for p in tiny_llama().parameters()]
    at_step_end, mid_window = run(mid_window=False), run(mid_window=True)
    assert all(not torch.equal(a.float(), s) for a, s in zip(at_step_end, start))  # it trained
    for a, b in zip(at_step_end, mid_window):
        assert torch.equal(a, b)


def test_trainer_resumes_full_offload_bit_for_bit_with_its_clipping_off(tmp_path):
    """The README's recipe for the optimizer's own clipping turns the Trainer's off
    (max_grad_norm=0), and the Trainer then calls clip_grad_norm_(params, inf) every step to log
    the norm. Its checkpoints could not be resumed (the inf was saved as the clipping limit and
    refused on load). A run saved at step 3 and resumed from there ends where the run without
    the stop ends, bit for bit: masters, moments and step counts."""
    made = []

    def make(model):
        opt = cpu_offload.offload_optimizer(adamw(model.parameters()), offload="full", grad_accum_steps=2,
                                            max_grad_norm=0.5)
        made.append(opt)
        return opt

    def trainer(out, **args):
        model = tiny_llama()
        opt = make(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
            report_to="none", use_cpu=True, disable_tqdm=True, seed=7, dataloader_num_workers=0, max_grad_norm=0.0,
            **args)
        return transformers.Trainer(model=model, args=args, train_dataset=rows(22), optimizers=(opt, sched)), opt

    def state(opt):
        return {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}

    try:
        whole, opt = trainer(tmp_path / "whole", save_strategy="no")
        whole.train()
        want = state(opt)
        stopped, _ = trainer(tmp_path / "stopped", save_strategy="steps", save_steps=3)
        stopped.train()
        resumed, opt = trainer(tmp_path / "stopped", save_strategy="no")
        resumed.train(resume_from_checkpoint=str(tmp_path / "stopped" / "checkpoint-3"))
        got = state(opt)
        assert got.keys() == want.keys()
        for i in want:
            for key in want[i]:
                assert torch.equal(got[i][key], want[i][key]), (i, key)
    finally:
        for opt in made:
            opt.close()
