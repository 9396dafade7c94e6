# The random training programs of test_random_programs.py under FSDP2 on the CPU: two or four
# gloo processes run one program on a sharded model (its checkpoints, resumes, edits, state
# writes through DTensors, and failed passes followed by reset_iter_state()) and must match one process running it unsharded, bit for bit,
# after every window: the global norm for clipping, a skipped step on every rank, the
# rollbacks and redos on each rank's shard. With four ranks the smallest parameter (5 elements)
# leaves one rank an empty shard. (Three ranks would not compare bit for bit: each rank runs
# the same batches, and the mean of three equal gradients is not always that gradient.)
import os
import sys

import pytest
import torch

from helpers import SMALL, assert_bit_equal, rank_main, run_ranks
from test_random_programs import Run, draw, expected_warnings

SEEDS = (0, 1)
def program_of(seed: int):
    """The program of ``seed``, without resumes from torch's checkpoint (the sharded ranks
    run no torch beside them). NOTE: a pass that fails does not use ``extra``: FSDP2 reduces
    the root group's gradients (``extra``'s) only once the whole backward has ended, so in
    a failed pass they reach the optimizer in one process only, and only there count a step."""
    program = draw(seed, "adamw", migrations=False)
    for w in program.windows:
        if w.fail >= 0:
            w.extra[w.fail] = False
    return program
# The sharded runs' options; overlap_forward puts its hooks on FSDP2's groups.
CONFIGS = {"small rings": lambda model: dict(SMALL), "overlap_forward": lambda model: dict(SMALL, overlap_forward=model)}


def program_worker(out_dir: str, seed: int, config: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(model):
        for layer in (model.l1, model.l2, model.head):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    program = program_of(seed)
    run = Run(program, lambda model, resumes: CONFIGS[config](model), shard=shard)
    with expected_warnings():
        states = [run.window(i, w) for i, w in enumerate(program.windows)]
    run.close()
    if dist.get_rank() == 0:
        torch.save(states, os.path.join(out_dir, f"program{seed}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_random_program_on_fsdp2_ranks_equals_one_process(tmp_path, world, seed, config):
    run_ranks(__file__, [str(tmp_path), str(seed), config], world=world, timeout_s=300)
    sharded = torch.load(tmp_path / f"program{seed}.pt")
    program = program_of(seed)
    run = Run(program, lambda model, resumes: dict(SMALL))
    try:
        with expected_warnings():
            for i, w in enumerate(program.windows):
                assert_bit_equal(sharded[i], run.window(i, w), f"window {i} ({w})")
                run.check_against_torch(i)
    finally:
        run.close()


if __name__ == "__main__" and len(sys.argv) == 4:
    rank_main(lambda: program_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
