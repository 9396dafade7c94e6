# The Llama-style decoder that examples/train_fsdp.py trains (and benchmarks/e2e.py and
# benchmarks/capacity.py measure).
#
# Scope: the model in plain torch: RMSNorm, causal attention through
# scaled_dot_product_attention, optional rotary embeddings, SwiGLU MLP, tied or untied head,
# GPT-2 style initialisation, and materialising a model built on the meta device one
# parameter at a time in a chosen dtype (for models whose fp32 copy must never exist).
# Non-goals: sharding and training (train_fsdp.py), KV caches, generation, loading
# pretrained weights.

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelConfig", "RMSNorm", "rotary_tables", "apply_rotary", "Attention", "SwiGLU", "Block",
           "Transformer", "init_parameter_", "materialize_", "count_parameters"]


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    ffn_dim: int = 5632
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    rope: bool = True
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotation angles, shape (max_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dimension of x (B, H, T, D); math in fp32."""
    T = x.shape[-2]
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:T], sin[:T]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must be a multiple of n_heads"
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = cfg.rope
        if cfg.rope:
            # NOTE: the tables are buffers of this module, not forward arguments: FSDP2
            # casts floating-point forward inputs to param_dtype (bf16) but leaves
            # buffers alone, so the angles keep fp32 precision.
            cos, sin = rotary_tables(self.head_dim, cfg.max_seq_len, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rope:
            q = apply_rotary(q, self.rope_cos, self.rope_sin)
            k = apply_rotary(k, self.rope_cos, self.rope_sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            init_parameter_(name, p, n_layers=self.cfg.n_layers, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return F.linear(x, self.embed.weight) if self.head is None else self.head(x)


@torch.no_grad()
def init_parameter_(name: str, p: torch.Tensor, *, n_layers: int, std: float = 0.02) -> None:
    """Initialise the Transformer parameter called `name` in place. GPT-2 style: N(0, std)
    for matrices and embeddings, residual output projections scaled down by
    sqrt(2 * n_layers) so the residual stream's variance stays bounded; RMSNorm weights 1."""
    if p.dim() < 2:
        p.fill_(1.0)
        return
    is_out = name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight")
    nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_layers) if is_out else std)


@torch.no_grad()
def materialize_(model: Transformer, device: torch.device, dtype: torch.dtype, *, std: float = 0.02) -> Transformer:
    """Give a Transformer built on the meta device real parameters on `device` in `dtype`,
    one at a time, initialised by the rule of reset_parameters (the same distribution, not
    the same random draws); the rotary tables are computed in fp32 as at construction.

    NOTE: each parameter is allocated and drawn directly in `dtype` on `device`, so no
    copy of the model in another dtype or on another device ever exists: the peak is the
    model itself. Call it before sharding; re-seed first for reproducible weights.
    """
    done: dict = {}
    for prefix, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:  # a tied weight is materialised once
                new = torch.empty(p.shape, dtype=dtype, device=device)
                init_parameter_(f"{prefix}.{name}" if prefix else name, new, n_layers=model.cfg.n_layers, std=std)
                done[id(p)] = nn.Parameter(new, requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]
        if isinstance(module, Attention) and module.rope:
            cos, sin = rotary_tables(module.head_dim, model.cfg.max_seq_len, model.cfg.rope_base)
            module.rope_cos, module.rope_sin = cos.to(device), sin.to(device)
    return model


def count_parameters(model: nn.Module) -> int:
    # DTensor.numel() is the global size, so this is the model size on any world size.
    return sum(p.numel() for p in model.parameters())
