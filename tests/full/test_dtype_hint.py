# The note full offload adds to the dtype error of a forward pass fed fp32 inputs after the
# in-place cast to bf16, and that its hooks are gone once a backward ended, or before the
# first forward of a compiled model.
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
    # The hint stays until a backward ends, then costs nothing.
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


def test_a_frozen_fp32_parameter_beside_cast_ones_is_named_in_the_note():
    # bf16 inputs, but a frozen fp32 bias stays fp32 beside its layer's bf16 weight: the note
    # names that parameter rather than blaming the inputs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].bias.requires_grad_(False)
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full", pinned_bytes=1 << 16)
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(torch.randn(2, 8, dtype=torch.bfloat16))
    notes = getattr(info.value, "__notes__", None) or [str(info.value).split("\n", 1)[1]]
    assert len(notes) == 1
    assert "Linear's frozen bias (torch.float32) no longer matches the torch.bfloat16 parameters" in notes[0]
    assert "torch.autocast(device_type, dtype=torch.bfloat16)" in notes[0]
    # fp32 inputs into that layer: the note names the inputs, which the error is about.
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model[2](torch.randn(2, 16))
    notes = getattr(info.value, "__notes__", None) or [str(info.value).split("\n", 1)[1]]
    assert "so fp32 inputs no longer match them" in notes[0] and "frozen" not in notes[0]
    # The remedy the note gives works: autocast runs the layer, and the frozen bias stays as it was.
    bias = model[2].bias.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8)).float().sum().backward()
    opt.step()
    assert torch.equal(model[2].bias, bias)
    opt.close()


def test_a_buffer_wider_than_the_cast_parameters_is_named_in_the_note():
    """spectral_norm keeps fp32 buffers (_u, _v) beside the weight it parametrizes: with the
    weight cast to bf16 its forward fails on bf16 inputs and under autocast alike, and the note
    told the user to do what they did (autocast, or bf16 inputs). It now names the buffers and
    remedies that work; cast, they run."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4))
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full", pinned_bytes=1 << 16)
    with pytest.raises(RuntimeError, match="same dtype") as info:
        model(torch.randn(2, 8, dtype=torch.bfloat16))
    notes = getattr(info.value, "__notes__", None) or [str(info.value).split("\n", 1)[1]]
    assert len(notes) == 1
    assert ("_SpectralNorm's buffers _u (torch.float32), _v (torch.float32) no longer match the torch.bfloat16 "
            "parameters") in notes[0]
    assert "cast those to torch.bfloat16 (the module's .to(torch.bfloat16)), or keep the parameters" in notes[0]
    model[0].parametrizations.weight[0].to(torch.bfloat16)  # the remedy it names
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.close()


def test_other_errors_are_left_alone():
    before = _global_hooks()
    model, opt = _wrapped()
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 9, dtype=torch.bfloat16))  # a shape error
    assert "cpu_offload" not in "".join(getattr(info.value, "__notes__", [])) + str(info.value)
    try:
        raise KeyError("outer")
    except KeyError:  # a forward inside an except block: the exception handled is not its own
        out = model(torch.randn(2, 8, dtype=torch.bfloat16))
    assert _global_hooks() == before + 2  # a forward alone leaves them: its backward may recompute
    out.float().sum().backward()
    assert _global_hooks() == before
    opt.close()


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_compiles_without_the_hooks(how):
    """torch.compile compiles for the process-wide hooks present, so hooks that went between a
    forward and its checkpointed recompute made it recompute with another graph. A model that
    holds a compiled module removes them before its first forward runs (and gets no note).
    One compiled whole in place is compiled with them, recompute included: they go with the
    backward, and its next forward compiles once more."""
    before = _global_hooks()
    model, opt = _wrapped()
    if how == "model.compile()":
        model.compile(backend="eager")
    else:
        model = torch.compile(model, backend="eager")
    assert _global_hooks() == before + 2
    out = model(torch.randn(2, 8, dtype=torch.bfloat16))
    assert _global_hooks() == before + (2 if how == "model.compile()" else 0)
    out.float().sum().backward()
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
