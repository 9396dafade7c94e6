# FSDP2 training example for cpu_offload.
#
# Scope: the Llama-style decoder of llama_model.py, sharded with fully_shard per block, the
# output head with the final norm, and the root, under a bf16 MixedPrecisionPolicy, trained
# on synthetic tokens generated on the device, with the optimizer wrapped by
# cpu_offload.offload_optimizer. Cosine LR schedule with warm-up, one log line per step,
# torch.distributed.checkpoint save/resume.
#
# Runs as:
#   python examples/train_fsdp.py --preset tiny                        # seconds, on a laptop CPU
#   python examples/train_fsdp.py --offload full                       # 1 GPU (or CPU)
#   torchrun --nproc-per-node 8 examples/train_fsdp.py --offload full  # N GPUs
#
# Non-goals: real data loading, tensor/pipeline parallelism, activation checkpointing,
# torch.compile. benchmarks/e2e.py imports the model, data and step code from here.

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cpu_offload
from llama_model import ModelConfig, Transformer, count_parameters  # noqa: F401 (e2e.py uses them from here)

GIB = float(1 << 30)


# ------------------------------------------------------------------- sharding


def build_model(cfg: ModelConfig, device: torch.device, *, fsdp: bool = True,
                offload_policy=None, seed: int = 0) -> Transformer:
    """Build the model on `device` and, with fsdp, shard it (shard_model).

    NOTE: every rank builds the full model from the same seed and fully_shard keeps
    only its shard, so the initial weights do not depend on the world size. For a
    model that does not fit one device, build it on the meta device instead, shard,
    then `to_empty` and initialise.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    if fsdp:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = dict(mesh=mesh, mp_policy=mp)
        if offload_policy is not None:
            kw["offload_policy"] = offload_policy
        shard_model(model, **kw)
    return model


def shard_model(model: Transformer, **kw) -> None:
    """fully_shard per block, the final norm with the output head, then the root (the
    embedding).

    NOTE: the head's group is reduce-scattered right after the head's backward, so its
    gradient is the first to reach the optimizer; in the root's group it would arrive with
    the embedding's, at the very end of backward. Its backward follows its forward at once,
    so it keeps its weights gathered in between.
    """
    for block in model.blocks:
        fully_shard(block, **kw)
    if model.head is not None:
        fully_shard([model.norm, model.head], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)


# ---------------------------------------------------------------- optimizer, LR


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only, none on norm weights."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, *, name: str, lr: float, weight_decay: float,
                    offload: str, grad_accum: int, state_dtype: torch.dtype = torch.float32, gpu_state=None,
                    overlap_forward: bool = False, stream_share: float = 0.0):
    """AdamW or SignSGD over `model`, wrapped for `offload`; `state_dtype` (AdamW's
    moments in host RAM), `gpu_state` (a byte budget or "auto" for state kept on the
    GPU), `overlap_forward` (the next forward starts while the CPU finishes the step) and
    `stream_share` (the share of the host state the GPU steps) are options of
    offload="full" only."""
    if offload != "full" and (state_dtype != torch.float32 or gpu_state is not None or overlap_forward
                              or stream_share):
        raise ValueError(f"state_dtype={state_dtype}, gpu_state={gpu_state!r}, overlap_forward={overlap_forward} "
                         f"and stream_share={stream_share} need offload='full', got offload={offload!r}")
    groups = param_groups(model, weight_decay)
    if name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    elif name == "sign_sgd":
        opt = cpu_offload.SignSGD(groups, lr=lr)
    else:
        raise ValueError(f"unknown optimizer {name!r}: expected 'adamw' or 'sign_sgd'")
    # NOTE: offload="none" keeps the plain torch optimizer, so the baseline touches no
    # cpu_offload code (offload_optimizer would return it unchanged anyway).
    if offload == "full":
        opt = cpu_offload.offload_optimizer(opt, offload=offload, grad_accum_steps=grad_accum, state_dtype=state_dtype,
                                            gpu_state=gpu_state, overlap_forward=model if overlap_forward else None,
                                            stream_share=stream_share)
    elif offload != "none":
        opt = cpu_offload.offload_optimizer(opt, offload=offload, grad_accum_steps=grad_accum)
    return opt


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to min_ratio at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(opt, *, lr: float, warmup: int, total: int, min_ratio: float,
                   start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    # NOTE: the schedule is a pure function of the absolute step, so a resumed run
    # reproduces the uninterrupted run's LR exactly; the base LR comes from the flag,
    # not from whatever lr the loaded optimizer state carries.
    for group in opt.param_groups:
        group["lr"] = lr
        group["initial_lr"] = lr
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: lr_factor(i + start_step, warmup=warmup, total=total, min_ratio=min_ratio))


# ------------------------------------------------------------------------- data


# Cached per (seed, vocab_size, device): the permutation's cyclic order and each
# token's index in it.
_WALK_CYCLES: dict = {}


def walk_cycle(seed: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The data's permutation as (order, index): perm[order[i]] = order[(i + 1) % vocab_size],
    and index[token] is the token's position in `order`.

    NOTE: the permutation is one random cycle through the whole vocabulary, drawn on
    the CPU from `seed` alone (not from step or micro-batch), so every step, rank and
    device walks the same one and no row is caught in a short cycle; a walk of t steps
    from a token is then one gather: order[(index[token] + t) % vocab_size].
    """
    key = (seed, vocab_size, str(device))
    cached = _WALK_CYCLES.get(key)
    if cached is None:
        g = torch.Generator().manual_seed((seed ^ 0x5DEE_CE66D) & 0x7FFF_FFFF_FFFF_FFFF)  # not a batch's seed
        order = torch.randperm(vocab_size, generator=g)
        index = torch.empty_like(order)
        index[order] = torch.arange(vocab_size)
        cached = _WALK_CYCLES[key] = (order.to(device), index.to(device))
    return cached


def synthetic_batch(step: int, micro: int, *, rank: int, world: int, batch_size: int,
                    seq_len: int, vocab_size: int, seed: int, device: torch.device):
    """Inputs and targets (batch_size, seq_len) for this rank, generated on `device`.

    Each row is a walk of a fixed random permutation of the vocabulary (next token =
    perm[token], see walk_cycle) from a random start, with 10% of tokens replaced at
    random. A model learns the permutation as a lookup table within a few hundred steps
    and uses the context to see past a replaced token; the replaced tokens themselves
    (about 10%) are unpredictable, so the loss floor is about 0.1·ln(vocab_size) + 0.33
    (1.36 for 32000 tokens, 0.88 for 256), against ln(vocab_size) at chance.
    NOTE: the global batch is drawn from a seed of (seed, step, micro) and each rank
    takes its rows, so N ranks × B rows see the same samples as 1 rank × N·B rows and a
    resumed run sees the same batches as an uninterrupted one.
    """
    order, index = walk_cycle(seed, vocab_size, device)
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003 + step) * 1_009 + micro) & 0x7FFF_FFFF_FFFF_FFFF)
    n, L = world * batch_size, seq_len + 1
    start = torch.randint(0, vocab_size, (n, 1), generator=g, device=device)
    seq = order[(index[start] + torch.arange(L, device=device)) % vocab_size]  # start, perm[start], ...
    noise = torch.randint(0, vocab_size, (n, L), generator=g, device=device)
    replace = torch.rand((n, L), generator=g, device=device) < 0.1
    seq = torch.where(replace, noise, seq)[rank * batch_size:(rank + 1) * batch_size]
    return seq[:, :-1], seq[:, 1:]


# ----------------------------------------------------------------- training loop


@dataclass
class StepSettings:
    batch_size: int
    seq_len: int
    grad_accum: int
    vocab_size: int
    seed: int
    amp_dtype: Optional[torch.dtype] = None  # autocast for an unsharded (plain) model
    max_grad_norm: Optional[float] = None  # clip the global gradient norm before each step


def clip_gradients(model: nn.Module, opt, max_norm: float) -> torch.Tensor:
    """Global-norm clipping; with offload="full" the gradients are on the host, so the
    optimizer clips them (same arguments and result as torch.nn.utils.clip_grad_norm_)."""
    if isinstance(opt, cpu_offload.FullCPUOffloadOptimizer):
        return opt.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def run_steps(model, opt, sched, s: StepSettings, *, first_step: int, last_step: int,
              device: torch.device) -> Iterator[dict]:
    """Train steps [first_step, last_step) and yield one record per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens_per_step = world * s.batch_size * s.seq_len * s.grad_accum
    amp = (torch.autocast(device.type, dtype=s.amp_dtype) if s.amp_dtype else nullcontext())
    for step in range(first_step, last_step):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(s.grad_accum):
            inputs, targets = synthetic_batch(
                step, micro, rank=rank, world=world, batch_size=s.batch_size,
                seq_len=s.seq_len, vocab_size=s.vocab_size, seed=s.seed, device=device)
            with amp:
                logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            # NOTE: gradients are reduce-scattered after every micro-batch (no
            # set_requires_gradient_sync(False)): with offload="full" each gradient
            # is streamed to the host and freed as soon as it is reduced.
            (loss / s.grad_accum).backward()
            loss_sum += loss.detach()
        lr = opt.param_groups[0]["lr"]
        if s.max_grad_norm is not None:
            clip_gradients(model, opt, s.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        dist.all_reduce(loss_sum)  # SUM: gloo has no AVG
        loss_value = loss_sum.item() / (s.grad_accum * world)  # .item() waits for the step
        if device.type == "cuda":
            # NOTE: the compute stream only, as a training loop waits (the loss above):
            # copies an optimizer leaves running on its own streams after step()
            # (offload="optimizer"'s copy-out) overlap the next step, as they do in any
            # loop; that step's time includes whatever they delay, so the step times
            # still add up to the run's wall time.
            torch.cuda.current_stream(device).synchronize()
        dt = time.perf_counter() - t0
        yield {
            "step": step + 1,
            "loss": loss_value,
            "lr": float(lr),
            "step_time_s": dt,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_step / dt,
            "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
            "offload": dict(opt.stats()) if callable(getattr(opt, "stats", None)) else None,
        }


# --------------------------------------------------------------------- logging


def _fmt_stat(key: str, value) -> str:
    if isinstance(value, (int, float)) and "bytes" in key:
        return f"{key}={value / GIB:.3f}GiB" if value >= (1 << 26) else f"{key}={value / (1 << 20):.1f}MiB"
    if isinstance(value, float):
        return f"{key}={value:.4f}"
    return f"{key}={value}"


def format_step(rec: dict, total_steps: int) -> str:
    parts = [f"step {rec['step']}/{total_steps}", f"loss {rec['loss']:.4f}",
             f"lr {rec['lr']:.2e}", f"{rec['step_time_s']:.3f}s",
             f"{rec['tokens_per_s']:,.0f} tok/s"]
    if rec["peak_gpu_gib"] is not None:
        parts.append(f"peak_gpu {rec['peak_gpu_gib']:.2f}GiB")
    else:  # CPU run: the process's peak resident set (ru_maxrss is in KiB on Linux)
        parts.append(f"peak_rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f}GiB")
    line = " | ".join(parts)
    if rec["offload"]:
        line += " | " + " ".join(_fmt_stat(k, v) for k, v in rec["offload"].items())
    return line


# ------------------------------------------------------------------ checkpoints


def resolve_checkpoint(path: str) -> str:
    """A step_NNNNNN directory as given, or the latest one under a --save root."""
    steps = sorted(d for d in os.listdir(path) if d.startswith("step_")) if os.path.isdir(path) else []
    return os.path.join(path, steps[-1]) if steps else path


def _checkpoint_state(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    # NOTE: with offload="full" the model state holds the bf16 compute copy and the
    # optimizer state the fp32 masters (host-shard DTensors), so a checkpoint is
    # resumed with the same --offload mode it was saved with.
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
            "train": {"step": torch.tensor(step)}}


def save_checkpoint(root: str, model, opt, step: int) -> str:
    import torch.distributed.checkpoint as dcp
    path = os.path.join(root, f"step_{step:06d}")
    dcp.save(_checkpoint_state(model, opt, step), checkpoint_id=path)
    return path


def load_checkpoint(path: str, model, opt) -> int:
    """Load model and optimizer state in place; return the step the checkpoint was taken at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    state = _checkpoint_state(model, opt, 0)
    dcp.load(state, checkpoint_id=path)
    # The model first: with offload="full" loading the optimizer refreshes the
    # compute copy from the fp32 masters.
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return int(state["train"]["step"])


# ------------------------------------------------------------------ distributed


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, **kwargs) -> None:
    """torchrun's env:// group when launched by torchrun, else a 1-rank group of our own."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        # NOTE: device_id makes NCCL form its communicator now, while the GPU is empty. Left
        # lazy, it forms at the first collective, which near the memory edge is the end of
        # backward with the GPU at its fullest, and fails there with "Failed to CUDA calloc".
        kwargs.setdefault("device_id", device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore(), **kwargs)


# ------------------------------------------------------------------------- main


# Settings that replace the defaults below (flags given explicitly still win).
PRESETS = {
    # A 0.1M-parameter model on 32-token sequences: trains in seconds on a laptop CPU.
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, seq_len=32, batch_size=4,
                 steps=20, warmup_steps=1, lr=1e-3),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="FSDP2 training with cpu_offload on synthetic tokens. The defaults "
                                "are the benchmark model (about 0.95B parameters, 2048-token sequences); "
                                "--preset tiny is a quick check that runs in seconds on a CPU.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="replace the defaults: " + "; ".join(
                       f"{name}: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
                       for name, values in PRESETS.items()))
    p.add_argument("--offload", choices=["none", "optimizer", "full"], default="full",
                   help="cpu_offload mode; none runs plain torch AdamW on the device (the baseline)")
    p.add_argument("--optimizer", choices=["adamw", "sign_sgd"], default="adamw",
                   help="sign_sgd is cpu_offload.SignSGD")
    p.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of AdamW's moments in host RAM (--offload full only); bfloat16 rounds them "
                        "after each step")
    p.add_argument("--gpu-state", default=None, metavar="BYTES|auto",
                   help="--offload full: device memory for the state of parameters spread over the model "
                        "(stepped on the GPU), or auto")
    p.add_argument("--overlap-forward", action="store_true",
                   help="--offload full: step() returns before the CPU has stepped every chunk; each module "
                        "of the next forward waits for its own new weights")
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm to this")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR of the cosine decay, as a share of --lr")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps of linear LR warm-up")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices and embeddings)")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary size")
    p.add_argument("--d-model", type=int, default=2048, help="model width")
    p.add_argument("--n-layers", type=int, default=16, help="transformer blocks")
    p.add_argument("--n-heads", type=int, default=16, help="attention heads")
    p.add_argument("--ffn-dim", type=int, default=5632, help="SwiGLU hidden size")
    p.add_argument("--tie-embeddings", action="store_true", help="the output head reuses the embedding matrix")
    p.add_argument("--no-rope", action="store_true", help="no rotary position embeddings")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the synthetic data")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when available; cpu runs gloo on the CPU")
    p.add_argument("--save", metavar="DIR", help="save DIR/step_NNNNNN at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", metavar="DIR", help="a step_NNNNNN checkpoint, or a --save DIR (latest step)")
    p.add_argument("--metrics", metavar="PATH", help="write one JSON line per step (rank 0)")
    preset = p.parse_known_args(argv)[0].preset
    if preset is not None:
        p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    if args.state_dtype != "float32" and (args.offload != "full" or args.optimizer != "adamw"):
        p.error("--state-dtype bfloat16 needs --offload full and --optimizer adamw")
    if args.overlap_forward and args.offload != "full":
        p.error("--overlap-forward needs --offload full")
    if args.gpu_state is not None:
        if args.offload != "full":
            p.error("--gpu-state needs --offload full")
        if args.gpu_state != "auto":
            try:
                args.gpu_state = int(args.gpu_state)
            except ValueError:
                p.error(f"--gpu-state must be a number of bytes or auto, got {args.gpu_state!r}")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                       n_heads=args.n_heads, ffn_dim=args.ffn_dim, max_seq_len=args.seq_len,
                       tie_embeddings=args.tie_embeddings, rope=not args.no_rope)


def main(argv=None) -> list[dict]:
    """Train as the flags say; return the step records. A process group that exists
    already (a caller's, e.g. a test driver's) is used and left open."""
    args = parse_args(argv)
    device = pick_device(args.device)
    owns_group = not dist.is_initialized()
    init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    if rank == 0:  # NOTE: said before building: the default model takes a while to build and shard
        with torch.device("meta"):
            n_params = count_parameters(Transformer(cfg))
        print(f"model {n_params / 1e6:.1f}M params {asdict(cfg)} | world {world} device {device.type} | "
              f"offload {args.offload} optimizer {args.optimizer} state_dtype {args.state_dtype} | "
              f"{args.steps} steps", flush=True)
    model = build_model(cfg, device, seed=args.seed)
    opt = build_optimizer(model, name=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, offload=args.offload,
                          grad_accum=args.grad_accum, state_dtype=getattr(torch, args.state_dtype),
                          gpu_state=args.gpu_state, overlap_forward=args.overlap_forward)
    start = load_checkpoint(resolve_checkpoint(args.resume), model, opt) if args.resume else 0
    sched = make_scheduler(opt, lr=args.lr, warmup=min(args.warmup_steps, args.steps),
                           total=args.steps, min_ratio=args.min_lr_ratio, start_step=start)
    if rank == 0 and args.resume:
        print(f"resumed {args.resume} at step {start}", flush=True)
    settings = StepSettings(batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
                            vocab_size=args.vocab_size, seed=args.seed, max_grad_norm=args.max_grad_norm)
    metrics = open(args.metrics, "a") if (args.metrics and rank == 0) else None
    records = []
    for rec in run_steps(model, opt, sched, settings, first_step=start, last_step=args.steps, device=device):
        records.append(rec)
        if rank == 0:
            print(format_step(rec, args.steps), flush=True)
            if metrics:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
        if args.save and args.save_every and rec["step"] % args.save_every == 0 and rec["step"] < args.steps:
            save_checkpoint(args.save, model, opt, rec["step"])
    if args.save:
        path = save_checkpoint(args.save, model, opt, max(start, args.steps))
        if rank == 0:
            print(f"saved {path}", flush=True)
    if metrics:
        metrics.close()
    if hasattr(opt, "close"):
        opt.close()
    if owns_group:
        dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
