# PEFT LoRA (q_proj/v_proj adapters on a frozen base) under full offload through
# HF Trainer, on a tiny Llama built from a config (CPU, nothing downloaded).
# Full offload casts only the trainable parameters (the adapters) to bf16; a
# base left in fp32 makes the forward mix dtypes and keeps the frozen weights at
# 4 B per parameter on the device, so the recipe casts the base to bf16 before
# adding the adapters (PEFT then makes the adapters fp32, full offload's masters).
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import cpu_offload  # noqa: E402
from helpers import Bf16MasterAdamW, adamw, loss_report, tiny_llama, token_rows  # noqa: E402

LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def lora_model(*, base_dtype):
    model = tiny_llama(seed=5).to(base_dtype)  # the recipe: the frozen base in the compute dtype
    torch.manual_seed(6)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    for n, p in model.named_parameters():  # give lora_B non-zero values so both adapters get gradients
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


def train(tmp_path, model, opt, n_rows=8, epochs=6):
    rows = [{"input_ids": r, "labels": r.clone()} for r in token_rows(n_rows, seed=77)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=epochs, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=7, dataloader_num_workers=0,
        max_grad_norm=0.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, optimizers=(opt, None))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_lora_over_an_fp32_base_keeps_the_frozen_weights_fp32():
    """Why the recipe casts the base: full offload leaves frozen parameters as they are."""
    model = lora_model(base_dtype=torch.float32)
    opt = cpu_offload.offload_optimizer(adamw([p for p in model.parameters() if p.requires_grad]), offload="full")
    try:
        dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
        print(f"LoRA over an fp32 base under full offload: (trainable, dtype) = {sorted(map(str, dtypes))}")
        assert dtypes == {(False, torch.float32), (True, torch.bfloat16)}
    finally:
        opt.close()


def test_peft_lora_trains_under_full_offload_through_trainer(tmp_path):
    model = lora_model(base_dtype=torch.bfloat16)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapters = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert all(p.dtype == torch.float32 for p in trainable)  # PEFT's adapters: fp32 over a bf16 base
    opt = cpu_offload.offload_optimizer(adamw(trainable, lr=3e-2), offload="full")
    try:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the whole model computes in bf16
        got = train(tmp_path, model, opt)
        masters = {n: opt.state[p]["master"].clone() for n, p in model.named_parameters() if p.requires_grad}
    finally:
        opt.close()
    # The reference: the same bf16 base, fp32 masters of the adapters stepped by plain torch AdamW.
    ref_model = lora_model(base_dtype=torch.bfloat16)
    for n, p in ref_model.named_parameters():
        if p.requires_grad:
            p.data = adapters[n].clone()  # fp32 adapters, as full offload's masters start
    ref_opt = Bf16MasterAdamW([p for p in ref_model.parameters() if p.requires_grad], lr=3e-2, betas=(0.9, 0.95),
                              weight_decay=0.1)
    want = train(tmp_path, ref_model, ref_opt)
    ref_opt.close()
    diff, line = loss_report("PEFT LoRA, Trainer, full offload vs bf16/fp32-master AdamW", got, want)
    print(line)
    assert len(got) == 24 and all(torch.isfinite(torch.tensor(got)))
    q = len(got) // 4
    assert sum(got[-q:]) / q < sum(got[:q]) / q - 0.05, line  # it learns (6 epochs over 8 rows)
    assert diff <= 2e-2, line
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(masters[n], adapters[n]), n  # every adapter trained
            assert torch.equal(p.detach(), masters[n].to(torch.bfloat16)), n
        else:
            assert torch.equal(p.detach(), frozen[n]), n  # the frozen base is unchanged
