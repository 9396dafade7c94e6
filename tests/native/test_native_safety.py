# Nothing reachable from Python aborts or corrupts the process: every dangerous sequence
# runs in a child process, which must exit 0 after catching the expected error (an abort
# or a segfault fails the test). Pool: bad CPU ids, too many threads, a pool whose threads
# cannot start. Validation cache: tensors changed in place after a first call (resize_,
# set_, .data =, t_, a storage resized under its tensor, a move to the GPU) are either
# refused with an error naming the argument or updated correctly in their new memory, and
# no other memory (the old storage, an unrelated canary) is written. Tensors without memory
# of their own (fake, functional) are refused naming the argument, never written through.
import subprocess
import sys
import textwrap

import pytest
import torch

POOL_PRELUDE = """
import os, torch
from cpu_offload import _C, kernels as k
from cpu_offload.topology import format_cpulist
allowed = sorted(os.sched_getaffinity(0))
outside = next(c for c in range(1024) if c not in allowed)

def check_kernel_runs():
    _C.set_min_elements_per_worker(1)       # use the pool even for this small call
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    p = torch.randn(1 << 16, generator=g)
    grad = torch.randn(1 << 16, generator=g)
    expected = p - 0.5 * torch.sign(grad)
    k.sign_sgd_step([p], [grad], lr=0.5, weight_decay=0.0)
    assert torch.equal(p, expected), "kernel result is wrong"

def expect(error, words, fn, *args):
    try:
        fn(*args)
    except error as e:
        assert all(w in str(e) for w in words), f"{e!r} lacks {words}"
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {error.__name__}")
"""

POOL_CASES = {
    "pin_outside_affinity_then_kernel": """
        expect(ValueError, ["cpus[0]=%d" % outside, format_cpulist(allowed)], k.pin_threads, [outside])
        assert k.get_pinned_cpus() is None
        check_kernel_runs()
        expect(ValueError, ["cpus[0]=%d" % outside, "affinity"], _C.pin_threads, [outside])  # native check
        assert k.get_pinned_cpus() is None
        check_kernel_runs()
    """,
    "pin_negative_and_huge_ids": """
        for bad in (-1, -(1 << 40), 1024, 1 << 20, 1 << 62, 10 ** 30):
            expect(ValueError, ["cpus[1]"], k.pin_threads, [allowed[0], bad])
        for bad in (-1, 1024, 1 << 20, 2 ** 31 - 1):
            expect(ValueError, ["cpus[1]=%d" % bad], _C.pin_threads, [allowed[0], bad])
        expect(TypeError, [], _C.pin_threads, [allowed[0], 1 << 40])  # not a C int at all
        assert k.get_pinned_cpus() is None
        check_kernel_runs()
    """,
    "bad_pin_keeps_a_running_pool_pinned": """
        k.set_num_threads(len(allowed))
        k.pin_threads([allowed[-1]])
        check_kernel_runs()                     # the pool exists and is pinned
        expect(ValueError, ["cpus[1]=%d" % outside], k.pin_threads, [allowed[0], outside])
        expect(ValueError, ["cpus[0]=%d" % outside], _C.pin_threads, [outside])
        assert k.get_pinned_cpus() == [allowed[-1]]
        check_kernel_runs()
        k.pin_threads(None)
        check_kernel_runs()
    """,
    "too_many_threads": """
        before = k.get_num_threads()
        expect(ValueError, ["n=%d" % (len(allowed) + 1), "%d CPUs" % len(allowed)],
               k.set_num_threads, len(allowed) + 1)
        expect(ValueError, ["n=64", "%d CPUs" % len(allowed)], k.set_num_threads, 64)
        for bad in (0, -3, 1025, 10 ** 6):
            expect(ValueError, ["num_threads"], _C.set_num_threads, bad)
        assert k.get_num_threads() == before
        check_kernel_runs()
    """,
    "threads_that_cannot_start": """
        import resource
        # Room for the process as it is plus 512 MiB: far fewer than 1024 thread stacks.
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (used + (512 << 20), hard))
        _C.set_num_threads(1024)                # allowed natively (oversubscription)
        expect(RuntimeError, [], check_kernel_runs)
        k.set_num_threads(len(allowed))         # the half-built pool was joined and freed
        check_kernel_runs()
    """,
}


CACHE_PRELUDE = """
import os, torch
from cpu_offload import _C, kernels as k
from cpu_offload.reference import adamw_reference_
_C.set_min_elements_per_worker(1)           # split even these small tensors over the pool
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
def rnd(scale=1.0):
    return torch.randn(64, 64, generator=g) * scale
H = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
params = [rnd() for _ in range(3)]
grads = [rnd() for _ in range(3)]
m = [rnd(0.1) for _ in range(3)]
v = [rnd(0.01).abs() for _ in range(3)]
steps = torch.zeros(3, dtype=torch.int64)

def step():
    k.adamw_step(params, grads, m, v, steps, **H)

def state():
    return [t.clone() for t in params + grads + m + v] + [steps.clone()]

def expected_after_step():
    s = state()
    p, gr, mm, vv = s[0:3], s[3:6], s[6:9], s[9:12]
    for i in range(3):
        adamw_reference_(p[i], gr[i], mm[i], vv[i], int(steps[i]) + 1, **H)
    return p + gr + mm + vv + [steps + 1]

def same(a, b):   # bit for bit: resize_ leaves new elements uninitialized, possibly NaN
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and
                                    torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                                    for x, y in zip(a, b))

def expect_refused(error, words):
    before = state()
    try:
        step()
    except error as e:
        assert all(w in str(e) for w in words), f"{e!r} lacks {words}"
    else:
        raise AssertionError(f"the call did not raise {error.__name__}")
    assert same(state(), before), "a refused call changed its tensors"

step()                                       # validated and cached
step()                                       # served from the cache
canary = [torch.full((64, 64), 7.0) for _ in range(16)]
"""

CACHE_CASES = {
    "resize_params_larger": """
        params[1].resize_(128, 64)            # reallocates: the cached pointer is freed memory
        canary += [torch.full((64, 64), 7.0) for _ in range(16)]   # likely to reuse it
        expect_refused(ValueError, ["grads[1] has 4096 elements but params[1] has 8192"])
    """,
    "resize_params_smaller": """
        storage = params[1].untyped_storage()
        old_bytes = bytes(storage)
        params[1].resize_(32, 64)             # same pointer, fewer elements
        expect_refused(ValueError, ["grads[1] has 4096 elements but params[1] has 2048"])
        assert bytes(storage) == old_bytes, "the storage behind the shrunk tensor was written"
    """,
    "resize_params_same_count_other_shape": """
        want = expected_after_step()
        params[1].resize_(32, 128)            # same pointer and bytes: a cache hit, as documented
        step()                                # works as on flat views of the same memory
        got = state()
        assert all(torch.equal(x.reshape(-1), y.reshape(-1)) for x, y in zip(got, want)), "wrong update"
        k.clear_cache()
        expect_refused(ValueError, ["grads[1] has shape (64, 64) but params[1] has shape (32, 128)"])
    """,
    "set_params_to_other_storage": """
        old = params[1].detach()              # keeps the old storage alive, to check it
        old_copy = old.clone()
        new = rnd()
        params[1].set_(new.untyped_storage(), 0, (64, 64))
        want = expected_after_step()
        step()
        assert same(state(), want), "set_ tensor not updated correctly in its new storage"
        assert params[1].data_ptr() == new.data_ptr()
        assert torch.equal(old, old_copy), "the old storage was written"
    """,
    "data_assigned_same_size": """
        old = params[0].detach()
        old_copy = old.clone()
        params[0].data = torch.empty(64, 64).normal_(generator=g)
        exp_avgs_old = m[2].detach()
        exp_avgs_old_copy = exp_avgs_old.clone()
        m[2].data = rnd(0.1)
        want = expected_after_step()
        step()
        assert same(state(), want), "tensors given new .data not updated correctly"
        assert torch.equal(old, old_copy) and torch.equal(exp_avgs_old, exp_avgs_old_copy), \\
            "an old storage was written"
    """,
    "data_assigned_other_size": """
        params[2].data = torch.empty(64, 65).normal_(generator=g)
        expect_refused(ValueError, ["grads[2] has 4096 elements but params[2] has 4160"])
        grads[0].data = torch.empty(4095)
        expect_refused(ValueError, ["grads[0] has 4095 elements but params[0] has 4096"])
    """,
    "dtype_strides_and_device_changed": """
        grads[0].data = grads[0].data.to(torch.float16)
        expect_refused(TypeError, ["grads[0]", "float16"])
        grads[0].data = grads[0].data.float()
        step()
        params[1].data = params[1].data.view(torch.int32)     # same bytes, other dtype of the same size:
        step()                                                # read as float32, as validated (documented)
        params[1].data = params[1].data.view(torch.float32)
        step()
        v[2].t_()                                             # same memory and size, transposed
        expect_refused(ValueError, ["exp_avg_sqs[2] is not contiguous"])
        v[2].t_()
        step()
    """,
    "storage_resized_under_tensor": """
        others = [t.clone() for t in params[:2] + grads + m + v]
        params[2].untyped_storage().resize_(0)   # NOTE: torch's own ops would crash on params[2] now
        try:
            step()
        except ValueError as e:
            assert "params[2] does not fit in its storage" in str(e), e
        else:
            raise AssertionError("the call did not raise ValueError")
        assert same([t.clone() for t in params[:2] + grads + m + v], others), "a refused call changed its tensors"
    """,
}

GPU_CASES = {
    "data_moved_to_gpu": """
        params[0].data = params[0].data.cuda()   # a dense CPU -> CUDA .data swap is allowed by torch
        try:
            step()
        except ValueError as e:
            assert "params[0] is a cuda" in str(e), e
        else:
            raise AssertionError("the call did not raise ValueError")
    """,
}


NO_MEMORY_PRELUDE = """
import os, warnings, torch
from cpu_offload import _C, kernels as k
from torch._subclasses.fake_tensor import FakeTensorMode
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
H = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
n = 1 + int(torch.randint(1000, (), generator=g))
with FakeTensorMode():
    fake, fake_steps, fake_empty = torch.zeros(n), torch.zeros(1, dtype=torch.int64), torch.zeros(0)

def plain(scale=1.0):
    return torch.randn(n, generator=g) * scale

def expect(error, words, fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn(*args, **kwargs)
        except error as e:
            assert all(w in str(e) for w in words), f"{e!r} lacks {words}"
        else:
            raise AssertionError(f"{fn.__name__} did not raise {error.__name__}")
    assert not caught, [str(w.message) for w in caught]   # no deprecated access to a fake's pointer
"""

NO_MEMORY_CASES = {
    "fake_tensor_in_every_role": """
        p, grad = plain(), plain()
        p0 = p.clone()
        words = ["has no memory of its own", "FakeTensor"]
        expect(ValueError, ["params[0]"] + words, k.sign_sgd_step, [fake], [grad], lr=0.1, weight_decay=0.0)
        expect(ValueError, ["grads[0]"] + words, k.sign_sgd_step, [p], [fake], lr=0.1, weight_decay=0.0)
        expect(ValueError, ["compute_params[0]"] + words, k.sign_sgd_step, [p], [grad], lr=0.1,
               weight_decay=0.0, compute_params=[fake])
        expect(ValueError, ["accumulators[0]"] + words, k.accumulate_, [fake], [grad], add=True)
        expect(ValueError, ["params[0]"] + words, k.sign_sgd_step, [fake_empty], [torch.zeros(0)], lr=0.1,
               weight_decay=0.0)
        m, v = plain(0.1), plain(0.01).abs()
        expect(ValueError, ["exp_avg_sqs[0]"] + words, k.adamw_step, [p], [grad], [m], [fake],
               torch.zeros(1, dtype=torch.int64), **H)
        expect(ValueError, ["steps"] + words, k.adamw_step, [p], [grad], [m], [v], fake_steps, **H)
        assert torch.equal(p, p0), "a refused call changed params"
    """,
    "fake_params_and_grads_are_not_called_overlapping": """
        with FakeTensorMode():
            other = torch.ones(n)
        try:
            k.sign_sgd_step([fake], [other], lr=0.1, weight_decay=0.0)
        except ValueError as e:
            assert "params[0] has no memory of its own" in str(e) and "overlap" not in str(e), e
        else:
            raise AssertionError("the call did not raise ValueError")
    """,
    "fake_tensor_after_a_cached_call": """
        p, grad = plain(), plain()
        k.sign_sgd_step([p], [grad], lr=0.1, weight_decay=0.0)
        k.sign_sgd_step([p], [grad], lr=0.1, weight_decay=0.0)   # served from the cache
        expect(ValueError, ["grads[0] has no memory of its own"], k.sign_sgd_step, [p], [fake], lr=0.1,
               weight_decay=0.0)
    """,
    "functional_tensor": """
        wrapped = torch._to_functional_tensor(plain())
        expect(ValueError, ["grads[0] has no memory of its own"], k.sign_sgd_step, [plain()], [wrapped], lr=0.1,
               weight_decay=0.0)
        expect(ValueError, ["params[0] has no memory of its own"], k.sign_sgd_step, [wrapped], [plain()], lr=0.1,
               weight_decay=0.0)
    """,
}


def _run(prelude, body):
    code = textwrap.dedent(prelude) + textwrap.dedent(body) + "\nprint('survived')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit status {proc.returncode} (negative: killed by a signal)\n{proc.stderr}"
    assert proc.stdout.strip().endswith("survived"), proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pool_survives(case):
    _run(POOL_PRELUDE, POOL_CASES[case])


def _cache_case(body):
    return textwrap.dedent(body) + "\nassert all(torch.equal(c, torch.full((64, 64), 7.0)) for c in canary), 'canary written'\n"


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_cache_never_uses_stale_memory(case):
    _run(CACHE_PRELUDE, _cache_case(CACHE_CASES[case]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cache_sees_a_device_change(case):
    _run(CACHE_PRELUDE, _cache_case(GPU_CASES[case]))


@pytest.mark.parametrize("case", list(NO_MEMORY_CASES))
def test_tensors_without_memory_are_refused(case):
    _run(NO_MEMORY_PRELUDE, NO_MEMORY_CASES[case])
