# The frameworks' set-up moves of optimizer state on a real GPU (marked gpu,
# skipped without CUDA): with full offload, accelerate's prepare() of the
# optimizer and Lightning's fit set-up (its _optimizer_to_device) must leave the
# host state on the host, so what they add to the GPU memory allocated before them
# stays within 5% of the bf16 weights (before the fix: the whole 12 B/parameter state,
# 6x the weights).
# About 150M parameters (300 MB of bf16 weights, 1.8 GB of host state).
# Run: pytest -m gpu tests/gpu/test_gpu_framework_state_moves.py
import pytest
import torch
import torch.nn as nn

import cpu_offload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D, LAYERS = 2048, 36


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(D, D, bias=False) for _ in range(LAYERS)]).cuda()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def full(model):
    return cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), offload="full")


def test_accelerate_prepare_adds_under_5_percent_of_weights():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model = make_model()
    before_wrap = torch.cuda.memory_allocated()
    opt = full(model)
    try:
        print(f"wrapping: allocated {before_wrap / 2**20:.1f} MiB before, {torch.cuda.memory_allocated() / 2**20:.1f} after")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        weights = weight_bytes(model)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        prepared = accelerate.Accelerator().prepare(opt)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        print(f"accelerate prepare(): weights {weights / 2**20:.1f} MiB, allocated before {base / 2**20:.1f} MiB, "
              f"peak {peak / 2**20:.1f} MiB")
        assert peak - base <= weights * 0.05
        x = torch.randn(8, D, device="cuda", dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        prepared.step()
        prepared.zero_grad()
        assert all(t.device.type == "cpu" for e in opt.state_dict()["state"].values() for t in e.values())
    finally:
        opt.close()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_lightning_fit_setup_adds_under_5_percent_of_weights():
    L = pytest.importorskip("lightning")
    seen = {}

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = make_model()

        def training_step(self, x, batch_idx):
            return self.model(x.to(torch.bfloat16)).float().pow(2).mean()

        def configure_optimizers(self):
            self.opt = full(self.model)  # the weights are bf16 from here on: measure from here
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            seen["weights"], seen["base"] = weight_bytes(self.model), torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return self.opt

        def on_train_start(self):  # after the strategy moved the optimizer state
            torch.cuda.synchronize()
            seen["peak"] = torch.cuda.max_memory_allocated()

    module = LM()
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(torch.randn(4, D), batch_size=2))
        weights, base, peak = seen["weights"], seen["base"], seen["peak"]
        print(f"Lightning fit set-up: weights {weights / 2**20:.1f} MiB, allocated before {base / 2**20:.1f} MiB, "
              f"peak {peak / 2**20:.1f} MiB")
        assert peak - base <= weights * 0.05
    finally:
        module.opt.close()
