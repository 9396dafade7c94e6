# The frameworks' set-up moves of optimizer state, run with their real code on
# full offload: accelerate's AcceleratedOptimizer (prepare(); HF Trainer and TRL
# go through it) round-trips load_state_dict(move_to_device(state_dict())),
# Lightning's _optimizer_to_device moves optimizer.state per key. On the CPU the
# device moves are counted: accelerate's move is replayed onto the "meta" device
# (what would have been copied to a GPU), Lightning's move_data_to_device is
# spied on. Nothing of the host state may be moved, and the masters stay
# bit-identical.
import pytest
import torch

pytest.importorskip("transformers")

import cpu_offload  # noqa: E402
from helpers import adamw, tiny_llama, token_rows  # noqa: E402


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _host_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for e in opt.state_dict()["state"].values()
               for k, t in e.items() if k != "step")


def _snapshot(opt):
    return {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}


def test_accelerate_prepare_moves_no_host_state(monkeypatch):
    accelerate = pytest.importorskip("accelerate")
    import accelerate.optimizer as acc_opt

    real = acc_opt.move_to_device
    moved, depth = [], [0]

    def spy(state, device):
        if depth[0]:  # move_to_device recurses through the module global: count the outer call only
            return real(state, device)
        depth[0] += 1
        try:
            on_meta = real(state, torch.device("meta"))  # what a GPU run would have copied
            moved.append(sum(t.numel() * t.element_size() for t in _tensors(on_meta) if t.is_meta))
            return real(state, device)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(acc_opt, "move_to_device", spy)
    model = tiny_llama(seed=3)
    opt = cpu_offload.offload_optimizer(adamw(model.parameters()), offload="full", grad_accum_steps=1)
    try:
        before = _snapshot(opt)
        accelerator = accelerate.Accelerator(cpu=True)
        model, prepared = accelerator.prepare(model, opt)
        print(f"accelerate prepare(): {moved} bytes sent to the device, host state {_host_bytes(opt)} bytes")
        assert moved == [0] and _host_bytes(opt) > 0
        after = _snapshot(opt)
        for i, entry in before.items():
            assert all(torch.equal(entry[k], after[i][k]) for k in entry), i  # masters bit-identical
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, entry in after.items():
            assert torch.equal(params[i].detach(), entry["master"].to(params[i].dtype))
        # It still trains through the prepared optimizer, and the state stays on the host.
        tokens = token_rows(2)
        loss0 = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss0)
        prepared.step()
        prepared.zero_grad()
        assert all(t.device.type == "cpu" for e in opt.state_dict()["state"].values() for t in e.values())
        assert any(int(e["step"]) == 1 for e in opt.state_dict()["state"].values())
        # accelerate's own state_dict() (its checkpoints) gets the whole state
        saved = prepared.state_dict()
        assert len(saved["state"]) == len(params) and all("master" in e for e in saved["state"].values())
    finally:
        opt.close()


def test_lightning_fit_moves_no_host_state(monkeypatch):
    L = pytest.importorskip("lightning")
    import lightning.fabric.utilities.optimizer as lopt

    real = lopt.move_data_to_device
    moved = []

    def spy(batch, device):
        moved.append(sum(t.numel() * t.element_size() for t in _tensors(batch)))
        return real(batch, device)

    monkeypatch.setattr(lopt, "move_data_to_device", spy)

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama(seed=4)

        def training_step(self, tokens, batch_idx):
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self):
            self.opt = cpu_offload.offload_optimizer(adamw(self.model.parameters()), offload="full")
            return self.opt

    module = LM()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(token_rows(6), batch_size=2))
    try:
        host = _host_bytes(module.opt)
        print(f"Lightning fit: {sum(moved)} bytes of optimizer state passed to move_data_to_device, host state {host}")
        assert sum(moved) == 0 and host > 0
        assert all(int(e["step"]) == 3 for e in module.opt.state_dict()["state"].values())
        # The teardown move (to the CPU) and a resume's move leave the entries as they were.
        params = [p for g in module.opt.param_groups for p in g["params"]]
        snap = _snapshot(module.opt)
        lopt._optimizer_to_device(module.opt, torch.device("meta"))
        assert sum(moved) == 0
        now = _snapshot(module.opt)
        assert all(torch.equal(snap[i][k], now[i][k]) for i in snap for k in snap[i])
        assert all(module.opt.state[p]["master"].device.type == "cpu" for p in params)
    finally:
        module.opt.close()
