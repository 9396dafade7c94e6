# The copy chain (marked gpu, skipped without CUDA): sliced copies are exact,
# in both directions, for contiguous and strided tensors; a small copy issued on
# another stream behind a bulk copy goes through at the next slice, not at the
# end of the bulk; a job waits for the events it is given.
# Run: python -m pytest -q -m gpu tests/gpu/test_gpu_copy_chain.py
import time

import pytest
import torch

from cpu_offload._state.copy_chain import SLICE_BYTES, CopyChain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_copies_are_exact(dtype):
    g = torch.Generator().manual_seed(time.time_ns() % (1 << 31))
    numel = 3 * SLICE_BYTES // torch.tensor([], dtype=dtype).element_size() + 12_345
    hosts = [torch.randn(numel, generator=g).to(dtype).pin_memory(),
             torch.randn(257, 129, generator=g).to(dtype).pin_memory(),
             torch.randn(64, 48, generator=g).to(dtype).t()]  # not contiguous: copied whole
    device = torch.device("cuda", torch.cuda.current_device())
    h2d, d2h = CopyChain(device), CopyChain(device)
    devs = [torch.empty_like(h, device="cuda") for h in hosts]
    copied_in = h2d.copy(list(zip(devs, hosts)), device_side=devs)
    back = [torch.empty_like(h).pin_memory() if h.is_contiguous() else torch.empty_like(h) for h in hosts]
    d2h.copy(list(zip(back, devs)), waits=(copied_in,), device_side=devs).synchronize()
    for host, dev, copy in zip(hosts, devs, back):
        assert torch.equal(dev.cpu(), host) and torch.equal(copy, host)


def test_a_small_copy_goes_through_at_the_next_slice():
    n = (1 << 30) // 4  # 1 GiB: ~20 ms at PCIe speed, 32 slices
    dev = torch.randn(n, device="cuda")
    host = torch.empty(n, pin_memory=True)
    small = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    chain = CopyChain(dev.device)
    done = chain.copy([(host, dev)], device_side=[dev])
    assert small.item() == 1.0  # a D2H copy on the compute stream, issued behind the bulk
    assert not done.query(), "the small copy waited for the whole bulk copy"
    done.synchronize()
    assert torch.equal(host, dev.cpu())


def test_jobs_wait_for_their_events_and_for_each_other():
    n = 4 * SLICE_BYTES // 4 + 7
    device = torch.device("cuda", torch.cuda.current_device())
    d2h, h2d = CopyChain(device), CopyChain(device)
    values = torch.randn(n, device="cuda")
    host = torch.zeros(n, pin_memory=True)
    slow = torch.cuda.Stream()
    slow.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(slow):
        torch.cuda._sleep(50_000_000)  # the copy-out may start only after this
        values.mul_(2)
    copied_out = d2h.copy([(host, values)], waits=(slow.record_event(),), device_side=[values])
    dev = torch.empty(n, device="cuda")
    h2d.copy([(dev, host)], waits=(copied_out,), device_side=[dev])
    again = torch.empty(n, device="cuda")
    last = h2d.copy([(again, dev)])  # issued after the copy above in the same chain
    last.synchronize()
    assert torch.equal(dev, values) and torch.equal(again, values)


def test_a_job_with_nothing_to_copy_still_waits_for_its_events():
    device = torch.device("cuda", torch.cuda.current_device())
    chain = CopyChain(device)
    chain.copy([(torch.empty(16, device="cuda"), torch.ones(16).pin_memory())]).synchronize()  # an earlier job
    slow = torch.cuda.Stream()
    with torch.cuda.stream(slow):
        torch.cuda._sleep(200_000_000)
    done = chain.copy([], waits=(slow.record_event(),))
    assert not done.query(), "the event of an empty job did not wait for the job's events"
    slow.synchronize()
    done.synchronize()
