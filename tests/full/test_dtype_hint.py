# The note full offload adds to the dtype error of a forward pass fed fp32 inputs after the
# in-place cast to bf16, and that its hooks are gone once a forward pass completed.
import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from cpu_offload import offload_optimizer


def _global_hooks() -> int:
    return len(nn_module._global_forward_hooks) + len(nn_module._global_forward_pre_hooks)


def _wrapped(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full", pinned_bytes=1 << 16,
                                    **options)


def test_fp32_inputs_get_a_note_saying_what_to_do():
    before = _global_hooks()
    model, opt = _wrapped()
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(torch.randn(2, 8))
    notes = getattr(info.value, "__notes__", None) or [str(info.value).split("\n", 1)[1]]
    assert len(notes) == 1  # once, although every enclosing module saw the exception
    assert "offload='full' cast the model's trainable parameters to torch.bfloat16" in notes[0]
    assert "torch.autocast(device_type, dtype=torch.bfloat16)" in notes[0]
    # The hint stays until a forward pass completes, then costs nothing.
    with pytest.raises(RuntimeError, match="same dtype"):
        model(torch.randn(2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8)).float().sum().backward()
    opt.step()
    assert _global_hooks() == before
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(torch.randn(2, 8))
    assert "cpu_offload" not in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    opt.close()


def test_other_errors_are_left_alone():
    before = _global_hooks()
    model, opt = _wrapped()
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 9, dtype=torch.bfloat16))  # a shape error
    assert "cpu_offload" not in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    try:
        raise KeyError("outer")
    except KeyError:  # a forward inside an except block completes: the hooks go
        model(torch.randn(2, 8, dtype=torch.bfloat16))
    assert _global_hooks() == before
    opt.close()


def test_no_hooks_without_a_cast_or_once_the_optimizer_is_gone():
    before = _global_hooks()
    _, opt = _wrapped(compute_dtype=torch.float32)
    assert _global_hooks() == before
    opt.close()
    _, opt = _wrapped()
    assert _global_hooks() == before + 2
    opt.close()
    del opt
    import gc

    gc.collect()
    assert _global_hooks() == before
