# CPU tests of examples/train_fsdp.py (with examples/llama_model.py) and examples/quickstart.py.
#
# Scope: the example trains the tiny preset for 3 steps on CPU with gloo, in 1 process and
# in 2 processes, with every --offload mode; a 2-process run saved at step 2 and resumed
# reproduces step 3 exactly; 1 process × 4 rows and 2 processes × 2 rows see the same
# samples, so their losses agree; SignSGD gives the same losses with and without full
# offload; full offload moves the bytes the design says, and trains alike with bf16
# moments (--state-dtype). The synthetic data (noisy walks of one permutation) and the
# model's options (tied head, no rotary embeddings) are checked on their own, and so is the
# order in which shard_model's groups deliver their gradients (the head's first). The
# quickstart is the README's quickstart, trains in every mode and prints one summary line per mode.
#
# NOTE: to keep the suite fast on a small CI host, each world size is one process per
# rank that imports torch once and calls the example's main(argv) for every case
# (this file, run as a script, is that driver); the cases run on one shared gloo group.
# The examples are found relative to this file; the package is the installed one
# (nothing here puts the source tree on sys.path or PYTHONPATH).

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODES = ("none", "optimizer", "full")
TINY = ["--device", "cpu", "--preset", "tiny"]
STEPS = 3
DRIVER_TIMEOUT_S = 240


def _cases(world: int, ckpt_root: str) -> list[dict]:
    """The runs for one world size: name, argv (metrics path added by the driver)."""
    if world == 1:
        cases = [{"name": f"{mode}_1p", "argv": ["--offload", mode, "--batch-size", "4", "--grad-accum", "2"]}
                 for mode in MODES]  # 1 process x 4 rows x 2 micro-batches
        cases += [{"name": f"{mode}_sign_sgd_1p", "argv": ["--offload", mode, "--optimizer", "sign_sgd",
                                                           "--batch-size", "2"]} for mode in ("none", "full")]
        cases.append({"name": "full_bf16_1p", "argv": ["--offload", "full", "--state-dtype", "bfloat16",
                                                       "--batch-size", "4", "--grad-accum", "2"]})
        for name, extra in (("full_ga1_1p", []), ("full_overlap_1p", ["--overlap-forward"])):
            cases.append({"name": name, "argv": ["--offload", "full", "--batch-size", "2", "--save",
                                                 os.path.join(ckpt_root, name), "--save-every", "2"] + extra})
        return cases
    cases = []
    for mode in MODES:  # 2 processes x 2 rows x 2 micro-batches: the same samples
        common = ["--offload", mode, "--batch-size", "2", "--grad-accum", "2"]
        ckpt = os.path.join(ckpt_root, mode)
        cases.append({"name": f"{mode}_2p", "argv": common + ["--save", ckpt, "--save-every", "2"]})
        cases.append({"name": f"{mode}_2p_resume", "argv": common + ["--resume", os.path.join(ckpt, "step_000002")]})
    return cases


# ------------------------------------------------------------------- driver


def _driver(out_dir: str) -> int:
    """Run every case of this world size through the example's main(); one process per rank."""
    from datetime import timedelta

    import torch.distributed as dist

    sys.path.insert(0, str(EXAMPLES))
    import train_fsdp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank() if world > 1 else 0
    for case in _cases(world, os.path.join(out_dir, "ckpt")):
        metrics = os.path.join(out_dir, f"{case['name']}.jsonl")
        argv = TINY + ["--steps", str(STEPS), "--metrics", metrics] + case["argv"]
        if rank == 0:
            print(f"=== {case['name']}: {' '.join(argv)}", flush=True)
        try:
            train_fsdp.main(argv)
        except Exception:
            with open(os.path.join(out_dir, f"{case['name']}.rank{rank}.err"), "w") as f:
                f.write(traceback.format_exc())
            raise  # a failed collective would leave the other rank out of step
    if world > 1:
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out_dir: Path) -> list[subprocess.Popen]:
    out_dir.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if world > 1:  # what torchrun sets
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--driver", str(out_dir)],
                                      cwd=out_dir, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch the 1-process and 2-process drivers together; wait; return their folders."""
    base = tmp_path_factory.mktemp("example_runs")
    dirs = {1: base / "w1", 2: base / "w2"}
    procs = {w: _launch(w, d) for w, d in dirs.items()}
    for _w, ps in procs.items():
        for p in ps:
            try:
                p.wait(timeout=DRIVER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return dirs


def _records(runs, world: int, name: str) -> list[dict]:
    folder = runs[world]
    errors = sorted(folder.glob(f"{name}.rank*.err"))
    if errors:
        pytest.fail(f"{name} raised:\n" + errors[0].read_text())
    path = folder / f"{name}.jsonl"
    if not path.exists():
        log = "\n".join((folder / f).read_text()[-3000:] for f in sorted(os.listdir(folder)) if f.endswith(".log"))
        pytest.fail(f"{name} did not run (an earlier case failed, or the driver died):\n{log}")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _example_module(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return __import__(name)


# ---------------------------------------------------------------- example tests


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2])
def test_example_trains(runs, world, mode):
    recs = _records(runs, world, f"{mode}_{world}p")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["step_time_s"] > 0 for r in recs)
    assert recs[0]["tokens_per_step"] == 4 * 32 * 2  # 4 rows x 32 tokens x 2 micro-batches
    stats = recs[-1]["offload"]
    if mode == "none":  # plain torch AdamW: no stats()
        assert stats is None
        return
    if mode == "optimizer":  # AdamW's two fp32 moments of this rank's shards, each way, once per step
        assert stats["h2d_bytes"] == stats["d2h_bytes"] == stats["host_bytes"] > 0
        # every parameter gets a gradient: all of it was copied in during the last backward
        assert stats["prefetched_bytes"] == stats["h2d_bytes"] and stats["step_copied_bytes"] == 0
        if world == 1:
            train_fsdp = _example_module("train_fsdp")
            n_params = train_fsdp.count_parameters(
                train_fsdp.Transformer(train_fsdp.model_config(train_fsdp.parse_args(TINY))))
            assert stats["d2h_bytes"] == 8 * n_params
        return
    assert stats["backward_passes"] == 2 and stats["chunks"] >= 1 and stats["kernel_s"] > 0
    if world == 1:  # bf16 gradients down for each micro-batch, bf16 weights up once
        train_fsdp = _example_module("train_fsdp")
        n_params = train_fsdp.count_parameters(
            train_fsdp.Transformer(train_fsdp.model_config(train_fsdp.parse_args(TINY))))
        assert stats["d2h_bytes"] == 2 * 2 * n_params and stats["h2d_bytes"] == 2 * n_params
    log = (runs[world] / "rank0.log").read_text()
    assert f"step {STEPS}/{STEPS} | loss" in log


@pytest.mark.parametrize("mode", MODES)
def test_one_and_two_processes_agree(runs, mode):
    one, two = _records(runs, 1, f"{mode}_1p"), _records(runs, 2, f"{mode}_2p")
    # Same weights, same samples: only the reduction order differs.
    assert one[0]["loss"] == pytest.approx(two[0]["loss"], rel=1e-3)
    for a, b in zip(one[1:], two[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)


@pytest.mark.parametrize("mode", MODES)
def test_resume_continues_exactly(runs, mode):
    straight = _records(runs, 2, f"{mode}_2p")
    resumed = _records(runs, 2, f"{mode}_2p_resume")
    assert [r["step"] for r in resumed] == [STEPS]
    assert resumed[0]["lr"] == straight[-1]["lr"]
    assert resumed[0]["loss"] == straight[-1]["loss"]


def test_sign_sgd_same_losses_with_full_offload(runs):
    plain, full = _records(runs, 1, "none_sign_sgd_1p"), _records(runs, 1, "full_sign_sgd_1p")
    # The same fp32 weights computed in bf16, stepped by the sign of the same gradients.
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert full[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-3)
    for a, b in zip(plain[1:], full[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
    assert full[-1]["offload"]["kernel_s"] > 0  # the CPU kernel ran it


def test_bf16_moments_train_like_fp32_moments(runs):
    fp32, bf16 = _records(runs, 1, "full_1p"), _records(runs, 1, "full_bf16_1p")
    assert [r["step"] for r in bf16] == list(range(1, STEPS + 1))
    assert bf16[0]["loss"] == fp32[0]["loss"]  # same weights, same batch, before any update
    for a, b in zip(fp32[1:], bf16[1:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
    # fp32 master + fp32 accumulator (grad_accum 2) + two bf16 moments: 12 B per element,
    # against 16 B with fp32 moments
    assert bf16[-1]["offload"]["host_bytes"] * 4 == fp32[-1]["offload"]["host_bytes"] * 3


def test_overlap_forward_trains_exactly_as_without(runs):
    plain, overlap = _records(runs, 1, "full_ga1_1p"), _records(runs, 1, "full_overlap_1p")
    assert [r["step"] for r in overlap] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in overlap] == [r["loss"] for r in plain]  # bit-identical training, checkpoints taken


def test_synthetic_batch_is_a_noisy_permutation_walk():
    import torch

    train_fsdp = _example_module("train_fsdp")
    cpu = torch.device("cpu")
    kw = dict(seq_len=256, vocab_size=1000, seed=3, device=cpu)
    order, index = train_fsdp.walk_cycle(3, 1000, cpu)
    assert train_fsdp.walk_cycle(3, 1000, cpu)[0] is order  # cached, not drawn again
    assert torch.equal(order.sort().values, torch.arange(1000)) and torch.equal(order[index], torch.arange(1000))
    perm = torch.empty_like(order)
    perm[order] = order.roll(-1)  # next token = perm[token]
    for step in (0, 7):  # one permutation for every step
        inputs, targets = train_fsdp.synthetic_batch(step, 1, rank=0, world=1, batch_size=64, **kw)
        assert inputs.shape == targets.shape == (64, 256) and torch.equal(inputs[:, 1:], targets[:, :-1])
        follows = (perm[inputs] == targets).float().mean().item()
        assert 0.77 < follows < 0.85, follows  # both tokens kept: 0.9 * 0.9
    # N ranks x B rows see the rows of 1 rank x N*B rows; the same (seed, step, micro), the same batch
    whole = train_fsdp.synthetic_batch(2, 0, rank=0, world=1, batch_size=4, **kw)[0]
    halves = [train_fsdp.synthetic_batch(2, 0, rank=r, world=2, batch_size=2, **kw)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)
    assert not torch.equal(train_fsdp.synthetic_batch(2, 1, rank=0, world=1, batch_size=4, **kw)[0], whole)
    other = train_fsdp.walk_cycle(4, 1000, cpu)[0]  # another seed, another permutation
    assert not torch.equal(other, order)


def test_tied_head_and_no_rope():
    import torch

    llama = _example_module("llama_model")
    kw = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=8)
    torch.manual_seed(0)
    untied, tied = llama.Transformer(llama.ModelConfig(**kw)), llama.Transformer(llama.ModelConfig(**kw, tie_embeddings=True))
    assert tied.head is None
    assert llama.count_parameters(untied) - llama.count_parameters(tied) == 64 * 32
    tokens = torch.tensor([[1, 2, 3]])
    tied(tokens).sum().backward()  # the head's gradient reaches every row of the shared matrix
    assert bool((tied.embed.weight.grad[10:] != 0).any())

    # Without rotary embeddings attention sees the earlier tokens as a set: swapping the
    # first two leaves the last position's output unchanged (rotary embeddings change it).
    swapped = torch.tensor([[2, 1, 3]])
    for rope in (False, True):
        torch.manual_seed(0)
        model = llama.Transformer(llama.ModelConfig(**kw, rope=rope)).eval()
        with torch.no_grad():
            same = torch.allclose(model(tokens)[0, -1], model(swapped)[0, -1], atol=1e-5)
        assert same is (not rope), f"rope={rope}"


def test_tiny_preset_and_explicit_flags(capsys):
    train_fsdp = _example_module("train_fsdp")
    args = train_fsdp.parse_args(["--preset", "tiny", "--d-model", "32"])
    assert args.d_model == 32 and args.n_layers == train_fsdp.PRESETS["tiny"]["n_layers"]  # an explicit flag wins
    with pytest.raises(SystemExit):
        train_fsdp.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for option in ("--d-model", "--steps", "--lr", "--offload", "--save-every"):
        block = help_text.split("\n  " + option, 1)[1].split("\n  -", 1)[0]  # its entry under the options
        assert "(default: " in block, option
    for bad in (["--offload", "none"], ["--offload", "optimizer"], ["--optimizer", "sign_sgd"]):
        with pytest.raises(SystemExit):
            train_fsdp.parse_args(["--preset", "tiny", "--state-dtype", "bfloat16"] + bad)
        assert "--state-dtype bfloat16 needs --offload full" in capsys.readouterr().err
    assert train_fsdp.parse_args(["--preset", "tiny", "--gpu-state", "auto"]).gpu_state == "auto"
    assert train_fsdp.parse_args(["--preset", "tiny", "--gpu-state", "4096"]).gpu_state == 4096
    for bad, message in ((["--gpu-state", "lots"], "--gpu-state must be a number"),
                         (["--gpu-state", "auto", "--offload", "none"], "--gpu-state needs --offload full")):
        with pytest.raises(SystemExit):
            train_fsdp.parse_args(["--preset", "tiny"] + bad)
        assert message in capsys.readouterr().err


# --------------------------------------------------------------- quickstart


def _code_blocks(markdown: str, section: str) -> list[str]:
    body = markdown.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_readme_quickstart_is_the_example():
    readme = (ROOT / "README.md").read_text()
    source = (EXAMPLES / "quickstart.py").read_text()
    code = re.sub(r"\A(#[^\n]*\n)*\n", "", source)  # without the header comment
    assert _code_blocks(readme, "Quickstart")[0] == code


def test_quickstart_trains_in_every_mode():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == len(MODES), proc.stdout  # one summary line per mode
    summary = {}
    for line in lines:
        m = re.match(r"(\w+) +loss ([\d.]+) -> ([\d.]+) \| weights on \w+: ([\d.]+) MiB", line)
        assert m, line
        first, last, weights = float(m[2]), float(m[3]), float(m[4])
        assert last < 0.5 * first, line
        summary[m[1]] = (weights, line)
    assert set(summary) == set(MODES)
    assert summary["full"][0] == pytest.approx(summary["none"][0] / 2, rel=1e-3)  # the bf16 compute copy only
    assert "host RAM" in summary["optimizer"][1] and "host RAM" not in summary["none"][1]
    for key in ("host RAM", "copied", "CPU kernels", "grad_norm"):
        assert key in summary["full"][1], summary["full"][1]


_ARRIVAL_ORDER = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import cpu_offload, train_fsdp
device = torch.device("cpu")
train_fsdp.init_distributed(device)
cfg = train_fsdp.ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, ffn_dim=128, max_seq_len=32)
model = train_fsdp.build_model(cfg, device, fsdp=True)
opt = cpu_offload.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), offload="full")
order = []
for name, p in model.named_parameters():
    p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
model(torch.randint(0, 256, (2, 32))).float().logsumexp(-1).mean().backward()
opt.step()
print(json.dumps(order))
"""


def test_the_sharded_head_is_the_first_gradient_and_the_embedding_the_last():
    # shard_model puts the head (with the final norm) in a group of its own: its gradient is
    # reduce-scattered right after its backward, so the CPU step starts on it, instead of
    # waiting with the embedding's, in the root's group, for the end of backward.
    out = subprocess.run([sys.executable, "-c", _ARRIVAL_ORDER, str(EXAMPLES)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    order = json.loads(out.stdout.splitlines()[-1])
    assert sorted(order[:2]) == ["head.weight", "norm.weight"] and order[-1] == "embed.weight"
    assert [n.split(".")[:2] for n in order[2:-1]] == [["blocks", b] for b in "210" for _ in range(7)]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--driver":
    sys.exit(_driver(sys.argv[2]))
