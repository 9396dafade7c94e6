# Host state stepped on the GPU (stream_share=), on CUDA (marked gpu, skipped without CUDA):
# the streamed parameters' master and moments stay in pinned host memory and cross to the GPU
# and back through a ring of slots. Over 20 steps, with a skipped NaN step, accumulation, bf16
# moments, overlap_forward and FSDP2 (one rank), the run equals the all-host run bit for bit;
# under steady clipping each streamed parameter equals the run that keeps its state on the GPU
# (both stepped once, with each window's final coefficient).
# Run: pytest -m gpu tests/gpu/test_stream_share_gpu.py
import pytest
import torch

from cpu_offload._full import streamed_step
from test_gpu_state_split import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def small_slots(monkeypatch):
    """Slots of 4096 elements: the model's weights span several, and the ring wraps in a step."""
    monkeypatch.setattr(streamed_step, "SLOT_ELEMENTS", 4096)


@pytest.mark.filterwarnings("ignore:cpu_offload. optimizer step skipped")
@pytest.mark.parametrize("accum, state_dtype, fsdp, overlap", [
    (1, torch.bfloat16, False, False), (2, torch.float32, False, False), (1, torch.bfloat16, False, True),
    (2, torch.bfloat16, True, False)])
def test_a_stream_share_trains_bit_for_bit_like_the_all_host_run(accum, state_dtype, fsdp, overlap, request,
                                                                  small_slots):
    if fsdp:
        request.getfixturevalue("single_rank_group")
    _, host, host_skipped = run(None, accum=accum, state_dtype=state_dtype, fsdp=fsdp, nan_at=7, overlap=overlap)
    _, split, split_skipped = run(None, accum=accum, state_dtype=state_dtype, fsdp=fsdp, nan_at=7, overlap=overlap,
                                  stream_share=0.5)
    assert host_skipped == split_skipped == 1
    assert 0 < sum(s[0] for s in split.values()) < len(split)  # a share of the parameters streamed
    for n in host:
        for a, b in zip(host[n][1:], split[n][1:]):
            assert (a == b) if isinstance(a, int) else torch.equal(a, b), n


def test_steady_clipping_streamed_parameters_equal_those_kept_on_the_gpu(small_slots):
    _, on_gpu, _ = run(1 << 40, accum=1, state_dtype=torch.bfloat16, max_grad_norm=1e-3)
    _, split, _ = run(None, accum=1, state_dtype=torch.bfloat16, max_grad_norm=1e-3, stream_share=0.5)
    streamed = [n for n, s in split.items() if s[0]]
    assert 0 < len(streamed) < len(split)
    for n in streamed:
        for a, b in zip(on_gpu[n][1:], split[n][1:]):
            assert (a == b) if isinstance(a, int) else torch.equal(a, b), n
