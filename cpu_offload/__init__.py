"""cpu_offload: train with fp32 masters, moments and gradients in host RAM.

The GPU keeps the bf16 compute copy of each parameter; native CPU kernels (AdamW,
SignSGD) run the optimizer step, overlapped with backward.
"""
from cpu_offload.optim import SignSGD
from cpu_offload.full_offload import FullCPUOffloadOptimizer
from cpu_offload.offload import offload_optimizer
from cpu_offload.state_offload import StateOffloadOptimizer

__all__ = ["SignSGD", "offload_optimizer", "FullCPUOffloadOptimizer", "StateOffloadOptimizer"]
