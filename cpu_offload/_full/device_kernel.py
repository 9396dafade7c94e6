# The device step of gpu_state= as one fused pass: AdamW on a CUDA parameter's flat fp32
# master, fp32 or bf16 moments and gradient, writing the compute copy, in one Triton kernel
# that reads and writes each element once (about 20 B per element with bf16 moments, where
# the same step as separate torch operations moves about 15 times that).
#
# NOTE: the rounding is the reference's (cpu_offload/reference.py), operation for operation:
# each multiplication and addition is rounded on its own (the kernel is compiled with
# enable_fp_fusion=False: no fused multiply-add), the division is tl.div_rn (IEEE, where
# Triton's "/" is approximate) and the square root tl.sqrt_rn (correctly rounded float32,
# equal to the reference's float64 square root rounded once). The float32 constants are
# rounded on the host, as the reference's float32 tensors hold them. The GPU test
# (tests/gpu/test_device_kernel.py) checks the kernel bit for bit against the reference.
#
# Scope: the kernel and whether it can run (device_state.check_fused_step verifies it on
# each GPU before its first use). Non-goals: which parameters are on the device,
# when they are stepped (device_state.py); SignSGD (few passes: it stays torch operations).

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

__all__ = ["BLOCK", "fused_adamw_available", "fused_adamw_"]

BLOCK = 2048  # elements per Triton program


def _f32(value: float) -> float:
    """``value`` rounded to float32 (then exact in any wider type)."""
    return float(torch.tensor(value, dtype=torch.float32))


@functools.lru_cache(maxsize=1)
def _kernel():
    """The compiled-on-first-use Triton kernel, or None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_scale, decay, beta1, one_minus_beta1, beta2,
                     one_minus_beta2, eps_hat, neg_step_size, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
        p = tl.load(p_ptr + offsets, mask=mask) * decay                                 # decoupled weight decay
        m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32) * beta1 + g * one_minus_beta1      # b1*m + (1-b1)*g
        v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32) * beta2 + (g * one_minus_beta2) * g  # b2*v + ((1-b2)*g)*g
        denom = tl.sqrt_rn(v) + eps_hat                                                  # sqrt(v) + eps*sqrt(bc2)
        p = p + tl.div_rn(neg_step_size * m, denom)                                      # p + (c*m)/denom
        tl.store(p_ptr + offsets, p, mask=mask)
        tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)               # bf16: rounded only here
        tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + offsets, p.to(out_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


def fused_adamw_available(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernel can step these flat tensors: all on one CUDA device,
    contiguous, and Triton importable."""
    first = tensors[0]
    return (first.is_cuda and all(t.device == first.device and t.is_contiguous() for t in tensors)
            and _kernel() is not None)


def fused_adamw_(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
                 out: Optional[torch.Tensor]) -> None:
    """adamw_reference_ on flat CUDA views in place, in one pass; ``out``: the compute copy,
    set to round(p) (``p`` itself when None)."""
    n = p.numel()
    if n == 0:
        return
    bc1 = 1.0 - beta1 ** step                      # in double, once per tensor, as the reference
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    grid = (-(-n // BLOCK),)
    _kernel()[grid](p, grad, m, v, p if out is None else out, n, _f32(grad_scale), _f32(1.0 - lr * weight_decay),
                    _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2), _f32(eps * bc2_sqrt),
                    _f32(-(lr * bc2_sqrt / bc1)), BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)

