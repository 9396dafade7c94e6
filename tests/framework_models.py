# Shared pieces of the framework tests (not a test module): a tiny Llama built
# from a config (nothing downloaded), random token data, the bf16/fp32-master
# reference optimizer that full offload is compared with, and the comparison.
#
# Scope: deterministic CPU runs a few seconds long. Non-goals: any framework
# import (each test module imports its framework through pytest.importorskip).

from __future__ import annotations

from collections import OrderedDict

import torch

VOCAB = 128
SEQ = 16

# Full offload against the bf16 reference: the two runs see the same bf16
# weights and gradients up to the rounding of AdamW's fp32 arithmetic (native
# kernel vs torch), which can flip a bf16 rounding of a weight now and then.
# Measured: at most 0.004 over 20-40 steps; 0.02 is 0.5% of a loss near 4.
BF16_LOSS_ATOL = 2e-2


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def token_rows(n: int, *, seed: int = 1234, seq: int = SEQ) -> torch.Tensor:
    """``n`` rows of ``seq`` tokens with a learnable pattern (each token is the
    previous one plus a per-row stride, mod the vocabulary) so losses fall."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(3, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 3, (n, 1), generator=g)
    return (start + stride * torch.arange(seq)) % (VOCAB - 3) + 3


def adamw(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


class Bf16MasterAdamW(torch.optim.Optimizer):
    """The reference for full offload: the model trains in bf16; fp32 masters
    are stepped by a plain torch.optim.AdamW with the bf16 gradients cast to
    fp32 (summed in fp32 over accumulated backward passes, as full offload
    does), and each step writes the masters back rounded to bf16.

    Build it over the fp32 model's parameters; it casts them to bf16 in place
    (as full offload does). LR schedulers drive the inner AdamW's groups.
    ``max_grad_norm`` clips the fp32 gradient sums with torch.nn.utils.clip_grad_norm_.
    """

    def __init__(self, params, max_grad_norm=None, **adamw_options):
        params = list(params)
        self.max_grad_norm = max_grad_norm
        self.masters = [p.detach().clone().float() for p in params]
        self.compute = params
        self.inner = torch.optim.AdamW(self.masters, **adamw_options)
        self.defaults = self.inner.defaults
        self.optimizer = self.inner
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                     "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self.hooks = []
        for p, m in zip(params, self.masters):
            p.data = p.data.to(torch.bfloat16)
            self.hooks.append(p.register_post_accumulate_grad_hook(lambda p, m=m: self._accumulate(p, m)))

    def close(self) -> None:
        """Stop taking the model's gradients (before another optimizer trains it)."""
        for h in self.hooks:
            h.remove()

    @staticmethod
    @torch.no_grad()
    def _accumulate(p, m):
        g = p.grad.float()
        m.grad = g if m.grad is None else m.grad.add_(g)
        p.grad = None

    # NOTE: properties, not copies: inner.load_state_dict (accelerate runs one at
    # prepare time) installs new group dicts, and the scheduler must follow them.
    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups):
        self.inner.param_groups = groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for m in self.masters if m.grad is not None], self.max_grad_norm)
        self.inner.step()
        for p, m in zip(self.compute, self.masters):
            p.copy_(m.to(torch.bfloat16))
            m.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for p, m in zip(self.compute, self.masters):
            p.grad = m.grad = None

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)


def assert_trains(losses, line: str = "") -> None:
    """The mean loss of the last quarter is clearly below that of the first."""
    q = max(1, len(losses) // 4)
    first, last = sum(losses[:q]) / q, sum(losses[-q:]) / q
    assert last < first - 0.1, f"loss did not fall: {first:.4f} -> {last:.4f}; {line}"


def loss_report(name: str, got, want) -> tuple[float, str]:
    """Largest absolute difference of two loss curves and a printable line."""
    got = [float(x) for x in got]
    want = [float(x) for x in want]
    assert len(got) == len(want), f"{name}: {len(got)} losses vs {len(want)}"
    diff = max(abs(a - b) for a, b in zip(got, want))
    line = (f"{name}: {len(got)} losses, max |diff| {diff:.3g}; "
            f"first {got[0]:.5f} vs {want[0]:.5f}, last {got[-1]:.5f} vs {want[-1]:.5f}")
    print(line)
    return diff, line


class FullOffloadMaker:
    """``make(model)`` for the train_* helpers: a full-offload AdamW per call, kept so the
    test can close them (their gradient hooks) when it ends."""

    def __init__(self, grad_accum_steps: int, **options) -> None:
        self.grad_accum_steps = grad_accum_steps
        self.options = options
        self.made: list = []

    def __call__(self, model):
        import cpu_offload

        self.made.append(cpu_offload.offload_optimizer(adamw(model.parameters()), offload="full",
                                                       grad_accum_steps=self.grad_accum_steps, **self.options))
        return self.made[-1]

    def close(self) -> None:
        for opt in self.made:
            opt.close()
