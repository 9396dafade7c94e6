# offload_optimizer: the one `offload` setting and its three values.
import pytest
import torch
import torch.nn as nn

from cpu_offload import FullCPUOffloadOptimizer, SignSGD, StateOffloadOptimizer, offload_optimizer


def opt_for(kind="adamw", **kw):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    params = model.parameters()
    if kind == "adamw":
        return model, torch.optim.AdamW(params, lr=1e-3, **kw)
    if kind == "sign":
        return model, SignSGD(params, lr=1e-3)
    return model, getattr(torch.optim, kind)(params, lr=1e-3)


def test_three_modes():
    _, opt = opt_for()
    assert offload_optimizer(opt, offload="none") is opt
    _, opt = opt_for()
    assert isinstance(offload_optimizer(opt), StateOffloadOptimizer)  # "optimizer" is the default
    model, opt = opt_for("sign")
    full = offload_optimizer(opt, offload="full", grad_accum_steps=2, pinned_bytes=1 << 16)
    assert isinstance(full, FullCPUOffloadOptimizer) and full.grad_accum_steps == 2
    assert model.weight.dtype == torch.bfloat16
    full.close()


def test_grad_accum_steps_is_accepted_by_every_mode():
    for mode in ("none", "optimizer"):
        _, opt = opt_for()
        offload_optimizer(opt, offload=mode, grad_accum_steps=4)
    _, opt = opt_for()
    with pytest.raises(ValueError, match="grad_accum_steps"):
        offload_optimizer(opt, offload="none", grad_accum_steps=0)


def test_unknown_mode_lists_the_three():
    _, opt = opt_for()
    for bad in ("cpu", "Full", None, True):
        with pytest.raises(ValueError, match="'optimizer', 'full', 'none'"):
            offload_optimizer(opt, offload=bad)


def test_unknown_keyword_is_a_type_error():
    _, opt = opt_for()
    with pytest.raises(TypeError, match="unexpected keyword argument.*pinned_bytes"):
        offload_optimizer(opt, offload="none", pinned_bytes=1)
    with pytest.raises(TypeError, match="unexpected keyword argument.*num_slot"):
        offload_optimizer(opt, offload="full", num_slot=2)  # no silent aliases
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        offload_optimizer(object(), offload="none")


def test_mode_keyword_points_to_offload():
    _, opt = opt_for()
    for key in ("mode", "offload_mode"):
        with pytest.raises(TypeError, match=rf"'{key}': the mode is set with offload=; did you mean "
                                            r"offload_optimizer\(optimizer, offload='full'\)"):
            offload_optimizer(opt, **{key: "full"})
    with pytest.raises(TypeError, match="pinned_bytes is an option of offload='full'"):
        offload_optimizer(opt, pinned_bytes=1 << 20)  # offload= left at its default


def test_full_accepts_only_adamw_and_sign_sgd():
    for kind in ("Adam", "SGD", "RMSprop"):
        model, opt = opt_for(kind)
        with pytest.raises(TypeError, match=rf"torch.optim.AdamW and cpu_offload.SignSGD on the CPU, got "
                                            rf"torch.optim.{kind}: use offload='optimizer'"):
            offload_optimizer(opt, offload="full")
        assert model.weight.dtype == torch.float32  # refused before anything changed
    _, opt = opt_for("Adam")
    with pytest.raises(TypeError, match="build torch.optim.AdamW instead"):
        offload_optimizer(opt, offload="full")
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        _, opt = opt_for(**{flag: True})
        with pytest.raises(ValueError, match=flag):
            offload_optimizer(opt, offload="full")


@pytest.mark.parametrize("inner", ["optimizer", "full"])
@pytest.mark.parametrize("outer", ["optimizer", "full"])
def test_an_offloaded_optimizer_is_not_offloaded_again(inner, outer):
    """A state-offload wrapper around full offload trained on other numbers than full offload
    alone, without a word; every wrapper of a wrapper is refused, by either entry point."""
    model, opt = opt_for()
    wrapped = offload_optimizer(opt, offload=inner)
    weight = model.weight.detach().clone()
    cls = StateOffloadOptimizer if outer == "optimizer" else FullCPUOffloadOptimizer
    for wrap in (lambda: offload_optimizer(wrapped, offload=outer), lambda: cls(wrapped)):
        with pytest.raises(TypeError, match=rf"already offloaded \(a {type(wrapped).__name__}"):
            wrap()
    assert torch.equal(model.weight, weight)  # nothing changed
    assert offload_optimizer(wrapped, offload="none") is wrapped
    if inner == "full":
        wrapped.close()


@pytest.mark.parametrize("first,second", [("optimizer", "optimizer"), ("optimizer", "full"),
                                          ("full", "optimizer"), ("full", "full")])
def test_a_torch_optimizer_has_one_live_wrapper(first, second):
    """A second wrapper over a torch optimizer that a live one drives was accepted (all but
    full over full): a state-offload wrapper over full offload checkpointed the torch
    optimizer's empty state, and two state-offload wrappers each moved the one state
    (on a GPU, one's copy-in could read host buffers the other's copy-out was writing)."""
    model, opt = opt_for()
    wrapped = offload_optimizer(opt, offload=first)
    weight = model.weight.detach().clone()
    cls = StateOffloadOptimizer if second == "optimizer" else FullCPUOffloadOptimizer
    for wrap in (lambda: offload_optimizer(opt, offload=second), lambda: cls(opt)):
        with pytest.raises(RuntimeError, match=rf"driven by a live {type(wrapped).__name__}.*close\(\) it"):
            wrap()
    assert model.weight.dtype == weight.dtype and torch.equal(model.weight, weight)  # nothing changed
    wrapped.close()
    if (first, second) != ("full", "full"):  # full offload cast the parameters: refused for that
        again = offload_optimizer(opt, offload=second)
        assert again.optimizer is opt
        if second == "full":
            again.close()


def test_a_state_offload_optimizer_over_parameters_full_offload_drives_is_refused():
    """A second torch optimizer over parameters a live full-offload optimizer drives, wrapped
    with offload="optimizer": full offload's hooks take every gradient during backward, so it
    never saw one and its step() silently did nothing. It is refused, naming the parameter;
    once the full-offload optimizer is closed it is accepted. The other way round too."""
    model, opt = opt_for()
    full = offload_optimizer(opt, offload="full")
    other = torch.optim.SGD([model.bias], lr=0.1)
    for wrap in (lambda: offload_optimizer(other), lambda: StateOffloadOptimizer(other)):
        with pytest.raises(RuntimeError, match=r"param_groups\[0\]\[0\] is driven by a live "
                                               r"FullCPUOffloadOptimizer.*never step it"):
            wrap()
    full.close()
    state = offload_optimizer(other)
    assert state.optimizer is other
    model.float()  # the parameters full offload cast, converted back
    with pytest.raises(RuntimeError, match=r"parameter param_groups\[0\]\[1\] is driven by a live "
                                           r"StateOffloadOptimizer.*never step it again.*close\(\) the other"):
        offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full")
    assert model.weight.dtype == torch.float32
    state.close()
    offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full").close()

@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("dtype, words", [
    (torch.float64, r"param_groups\[0\]\[0\] is float64: full offload steps fp32 masters.*model.float\(\)"),
    (torch.complex64, r"param_groups\[0\]\[0\] has dtype torch.complex64; full offload needs floating-point"),
])
def test_full_offload_refuses_parameters_it_would_not_step_as_torch_does(dtype, words):
    """A float64 model was wrapped without a word: its parameters cast to bf16, their masters
    rounded to float32 and every step computed in float32, where torch's AdamW steps in float64.
    It is refused at construction, the model left as it was, as complex parameters are."""
    torch.manual_seed(int(torch.randint(1 << 30, ())))
    model = nn.Linear(8, 4).to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=words):
        offload_optimizer(torch.optim.AdamW(model.parameters()), offload="full")
    for a, b in zip(before, model.parameters()):
        assert b.dtype == dtype and torch.equal(a, b)
    offload_optimizer(torch.optim.AdamW(model.parameters()), offload="optimizer").close()  # that mode takes them


def test_a_torch_optimizer_stepping_parameters_full_offload_drives_is_refused():
    """A plain torch optimizer (the one full offload wraps too, or an offload="optimizer" wrapper
    that gained them through add_param_group) over parameters a live full-offload optimizer drives never saw their
    gradients, which full offload's hooks take during backward: its step() silently left
    them as they were. Its step() is refused before anything changes, naming the parameter;
    the full-offload optimizer's own step, and any once it is closed, go on."""
    model, opt = opt_for()
    full = offload_optimizer(opt, offload="full")
    plain = torch.optim.SGD([model.bias], lr=0.1)
    other = nn.Linear(2, 2)
    state = offload_optimizer(torch.optim.SGD(other.parameters(), lr=0.1))
    state.add_param_group({"params": [model.weight]})
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    start = model.bias.detach().clone()
    model(x).float().pow(2).mean().backward()
    other(torch.randn(3, 2)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\[0\] is driven by a live FullCPUOffloadOptimizer"):
        plain.step()
    with pytest.raises(RuntimeError, match=r"the torch optimizer a live FullCPUOffloadOptimizer wraps.*step that one"):
        opt.step()  # the wrapped AdamW itself, which shares its param_groups with the wrapper
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\[0\] is driven by a live FullCPUOffloadOptimizer"):
        state.step()
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing stepped
    full.step()
    assert not torch.equal(model.bias, start)
    full.close()
    model.float()
    model(x.float()).pow(2).mean().backward()
    bias = model.bias.detach().clone()
    plain.step()
    assert torch.equal(model.bias, bias - 0.1 * model.bias.grad)


@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_a_wrapper_whose_construction_failed_does_not_hold_the_optimizer(monkeypatch, mode):
    import cpu_offload._full.optimizer as full_module
    from cpu_offload._state.staging import StateStaging

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    model, opt = opt_for()
    with monkeypatch.context() as patch:  # both fail after the wrapper took the optimizer
        if mode == "optimizer":
            patch.setattr(StateStaging, "hook_params", fail)
        else:
            patch.setattr(full_module, "StateMapping", fail)
        with pytest.raises(RuntimeError, match="injected") as failed:
            offload_optimizer(opt, offload=mode)
    assert failed.value.__traceback__ is not None  # the half-built wrapper is still referenced
    assert model.weight.dtype == torch.float32
    wrapped = offload_optimizer(opt, offload=mode)
    assert wrapped.optimizer is opt
    if mode == "full":
        wrapped.close()


def test_schedulers_accept_every_wrapper():
    for mode in ("optimizer", "full"):
        model, opt = opt_for()
        wrapped = offload_optimizer(opt, offload=mode)
        sched = torch.optim.lr_scheduler.LambdaLR(wrapped, lambda s: 0.5 ** s)
        x = torch.randn(2, 8, dtype=model.weight.dtype)
        model(x).float().sum().backward()
        wrapped.step()
        wrapped.zero_grad()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
        if mode == "full":
            wrapped.close()


def test_pin_memory_without_cuda_is_refused_at_the_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, opt = opt_for()
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        offload_optimizer(opt, pin_memory=True)
    with pytest.raises(TypeError, match="pin_memory must be True, False or None"):
        offload_optimizer(opt, pin_memory="yes")
    assert offload_optimizer(opt, pin_memory=False).pin_memory is False
