"""cpu_offload: train with fp32 masters, moments and gradients in host RAM.

The GPU keeps the bf16 compute copy of each parameter; native CPU kernels (AdamW,
SignSGD) run the optimizer step, overlapped with backward.
"""
from cpu_offload.optim import SignSGD

__all__ = ["SignSGD"]
