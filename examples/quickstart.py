# Quickstart: the README's quickstart, as a script (tests/test_examples.py checks that the
# two are the same code). A plain fp32 nn.Module on fp32 inputs, trained with each offload
# mode on the GPU when there is one, else on the CPU; one summary line per mode.
#
#   python examples/quickstart.py

import torch
import cpu_offload

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
teacher = torch.nn.Linear(256, 256).to(device)  # the function to learn

for offload in ("optimizer", "full", "none"):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt = cpu_offload.offload_optimizer(opt, offload=offload)  # "optimizer" (default) | "full" | "none"
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5))
    losses = []
    for _step in range(20):
        x = torch.randn(64, 256, device=device)  # fp32 inputs
        with torch.no_grad():
            target = teacher(x)
        # offload="full" casts the model's weights to bf16 in place (the fp32 masters live in
        # host RAM), so the forward runs under autocast, which also accepts the fp32 inputs.
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        opt.step()  # with "full": the update already ran during backward; step() closes the window
        opt.zero_grad()
        scheduler.step()  # torch LR schedulers keep working
        losses.append(loss.item())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # bytes on `device`
    line = f"{offload:<9} loss {losses[0]:.4f} -> {losses[-1]:.4f} | weights on {device}: {weights / 2**20:.2f} MiB"
    if offload != "none":
        stats = opt.stats()  # the last step's figures
        line += f", host RAM {stats['host_bytes'] / 2**20:.2f} MiB"
    if offload == "full":  # bf16 gradients down, bf16 weights up, the step on the CPU
        line += (f", copied {stats['d2h_bytes'] / 2**20:.2f} MiB down / {stats['h2d_bytes'] / 2**20:.2f} MiB up"
                 f", CPU kernels {stats['kernel_s'] * 1e3:.1f} ms, grad_norm {stats['grad_norm']:.3f}")
        opt.close()  # removes its gradient hooks and frees its pinned buffers
    print(line)
