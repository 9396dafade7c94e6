# The mappings through which full offload's host state is read (``opt.state``,
# ``state_dict()["state"]``), shaped so that the frameworks' device-placement
# helpers leave the host state where it is.
#
# Frameworks move optimizer state at set-up: accelerate's AcceleratedOptimizer
# runs ``load_state_dict(move_to_device(state_dict()))`` (HF Trainer and TRL
# through it), Lightning's ``_optimizer_to_device`` moves ``optimizer.state``
# at set-up, after a resume and at teardown. Plain AdamW's state is empty then;
# full offload's is the whole host state from construction (12 B per
# parameter), which would land on the GPU at once. The types below rely on
# exactly what those helpers test (accelerate 1.15, Lightning 2.6):
#
# - accelerate's ``move_to_device`` recurses into ``dict``, list and tuple and
#   calls ``.to`` on ``torch.Tensor``. torch DCP's in-place load
#   (``_init_state_dict``) keeps only dicts, lists and tensors (any other
#   mapping becomes None), so ``state_dict()`` entries must stay dicts, and
#   accelerate's round trip still copies them (not solved here: see
#   tests/frameworks/test_framework_state_moves.py). ``SavedEntry`` builds one entry.
# - Lightning moves per key when an entry ``isinstance(v, MutableMapping)``,
#   else ``optimizer.state[p] = apply_to_collection(v, Tensor, ...)``, which
#   recurses only into Mapping, Sequence and dataclass values. A ``StateEntry``
#   is none of those (duck-typed: ``[]``, ``keys``, ``items``, ``get``...), so
#   it comes back unchanged and assigning the same entry back is a no-op.
#
# - accelerate's ``move_to_device`` copies every tensor inside dicts, and torch DCP's
#   in-place load needs dict entries, so no entry type serves both. Instead,
#   ``for_device_placement()`` recognises the one call that is a pure device round
#   trip, ``state_dict()`` from ``AcceleratedOptimizer.__init__``: it then gets the
#   param groups marked ``HOST_STATE_KEPT`` and no state, and ``load_state_dict`` of
#   such a dict applies the groups alone. Any other caller gets the whole state.
#
# ``opt.state`` is one ``StateMapping`` built at construction: O(1) per
# lookup, every trainable parameter from construction on (torch DCP's
# ``_init_optim_state`` fake-steps an optimizer whose state is empty, which
# full offload cannot take). Writes (``opt.state[p]["exp_avg"] = t``) copy the
# values into the host state, between steps only. The step count is one live 0-d tensor
# per parameter, as torch's (made at the first read: ParamRecord.live_step), shared with
# ``state_dict()``'s entry; written in place, it is taken as an assignment when the count is
# next used (``step_edits``: the optimizer takes them where it takes weights edited in place).
# The master is one live tensor per parameter too (ParamRecord.live_master), with a version counter
# of its own: a write into it is seen when the next backward begins (the optimizer raises then,
# or warns under FSDP2).
#
# Non-goals: the checkpoint format and its validation (checkpoint.py).

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Callable

import torch

from cpu_offload._common.dtensor import as_dtensor_like, local_of
from cpu_offload._full.host_state import ParamRecord, write_compute_copies

__all__ = ["SavedEntry", "StateEntry", "NoState", "StateMapping", "HOST_STATE_KEPT", "for_device_placement", "host_value",
           "step_value", "step_edits", "take_step_edits", "MASTER_STEP"]

# Param-group key of a state_dict that holds no state because the state stayed on the host.
HOST_STATE_KEPT = "host_state_kept"
_OWN_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))


def for_device_placement() -> bool:
    """Whether the running ``state_dict()`` call is accelerate's set-up round trip
    (``AcceleratedOptimizer.__init__``: ``load_state_dict(move_to_device(state_dict()))``).

    NOTE: the first frame outside this package and torch decides; a Lightning proxy or a
    state-dict hook in between is inside them. accelerate's own ``state_dict()`` (its
    checkpoints) is another function and gets the whole state.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame = frame.f_back
    return (frame is not None and frame.f_code.co_name == "__init__"
            and frame.f_globals.get("__name__") == "accelerate.optimizer")

_HOST_KEYS = ("master", "exp_avg", "exp_avg_sq")
MASTER_STEP = "master_step"  # the step count the saved master belongs to (checkpoint.py)


def host_value(value, where: str, rec: ParamRecord) -> torch.Tensor:
    """A loaded or assigned state tensor as a flat view of its local values, checked."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} ({rec.name}) must be a tensor, got {type(value).__name__}")
    local = local_of(value)
    if tuple(local.shape) != tuple(rec.shape) and not (local.dim() == 1 and local.numel() == rec.numel):
        raise ValueError(f"{where} ({rec.name}) has local shape {tuple(local.shape)}, expected {tuple(rec.shape)}")
    if not local.is_floating_point():
        raise TypeError(f"{where} ({rec.name}) has dtype {local.dtype}, expected a floating-point tensor")
    if not _holds_values(local):
        raise ValueError(f"{where} ({rec.name}) holds no values to copy (a meta or fake tensor, or one without "
                         "storage of its own): load the state's real values")
    return local.detach().reshape(-1)


def _holds_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are in memory that a copy can read.

    NOTE: a meta tensor's storage and a fake tensor's (torch.compile, FakeTensorMode: it
    reports a real device) are on the meta device; a wrapper subclass may have none. Checked
    before anything is written: their copy fails only once the entries before them are.
    """
    try:
        return torch.Tensor.untyped_storage(t).device.type != "meta"
    except (RuntimeError, NotImplementedError):
        return False


# NOTE: the kernels keep step counts as int64 and add 1 before each step (the bias
# corrections 1 - beta**(step + 1) are taken in double, fine at any count): a count below
# 2**62 leaves room for 2**62 more steps, far beyond any run.
_MAX_STEP = 2**62


def step_value(value, where: str, rec: ParamRecord) -> int:
    """A loaded or assigned step count, checked: a whole number in [0, _MAX_STEP)."""
    try:
        step = value if type(value) is int else float(torch.as_tensor(value).item())
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{where} ({rec.name}) must be a number or a one-element tensor, got {value!r}") from None
    if not (0 <= step < _MAX_STEP and step == int(step)):  # NOTE: refuses NaN and inf before int()
        raise ValueError(f"{where} ({rec.name}) must be a non-negative whole number below 2**62, got {step}")
    return int(step)


def step_edits(records) -> list:
    """``[(rec, count)]``: the step counts written in place into the live step tensors
    (``opt.state[p]["step"]``, a ``state_dict()``'s ``step``) since the library last wrote
    them, each checked as an assignment is: a bad one raises before anything changes."""
    edited = [rec for rec in records if rec.step_tensor is not None and rec.step_edited()]
    return [(rec, step_value(rec.step_tensor, f"opt.state[{rec.name}]['step']", rec)) for rec in edited]


def take_step_edits(edits) -> None:
    """The edited counts become the records' counts, as ``opt.state[p]["step"] = count`` would."""
    for rec, count in edits:
        rec.set_step(count)


class SavedEntry(Mapping):
    """One parameter's ``state_dict()`` entry: a fixed mapping of tensors
    (checkpoint.py hands it out as a dict); pickles as an ``OrderedDict``."""

    __slots__ = ("_data",)

    def __init__(self, data=()):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __reduce__(self):
        return (OrderedDict, (list(self._data.items()),))

    def __repr__(self) -> str:
        return f"SavedEntry({self._data!r})"


def host_keys(rec: ParamRecord) -> tuple:
    return tuple(key for key in _HOST_KEYS if getattr(rec, key) is not None)


def saved_entry(rec: ParamRecord) -> SavedEntry:
    """A ``state_dict()`` entry, all live: the step count (``opt.state[p]["step"]``'s tensor, as
    torch's entry is its state), the master's count (its own tensor: checkpoint.py says why
    there are two), the master (``opt.state[p]["master"]``'s tensor) and views of the moments."""
    out = {"step": rec.live_step()}
    for key in host_keys(rec):
        out[key] = rec.live_master() if key == "master" else as_dtensor_like(getattr(rec, key).view(rec.shape), rec.param)
    out[MASTER_STEP] = rec.live_master_step()
    return SavedEntry(out)


class StateEntry:
    """Live view of one parameter's host state: ``step`` (one live 0-d float32 tensor, as
    torch's; an in-place edit counts as an assignment), ``master`` (one live tensor over the
    host buffer: ParamRecord.live_master), ``exp_avg``, ``exp_avg_sq`` (views of the host buffers).

    ``entry[key] = value`` copies ``value`` into the host state (any device or
    float dtype; the moments are rounded to their stored dtype); ``"master"``
    also refreshes the compute copy, ``"step"`` sets the step count. Both go through
    the optimizer's guards: a write between steps only, a read once the last step landed
    and not while the window's step is applied before step().

    NOTE: deliberately neither a Mapping nor a MutableMapping (see the header:
    Lightning's device move leaves such values alone).
    """

    __slots__ = ("_rec", "_guard", "_read_guard", "_keys", "_views")

    def __init__(self, rec: ParamRecord, guard: Callable[[str], None], read_guard: Callable[[str], None]):
        self._rec, self._guard, self._read_guard = rec, guard, read_guard
        self._keys = ("step",) + host_keys(rec)
        self._views: dict = {}  # key -> (flat state tensor, its view): made again only if the state moved

    def __getitem__(self, key):
        rec = self._rec
        if key not in self._keys:
            raise KeyError(key)
        self._read_guard(f"reading opt.state[{rec.name}][{key!r}]")
        if key == "step":
            step = rec.live_step()
            rec.show_step()  # NOTE: a count changed where no step ended (a backward that raised)
            return step
        if key == "master":
            return rec.live_master()
        flat = getattr(rec, key)
        cached = self._views.get(key)
        if cached is None or cached[0] is not flat:  # NOTE: gpu_state="auto" may move the state once
            cached = self._views[key] = (flat, as_dtensor_like(flat.view(rec.shape), rec.param))
        return cached[1]

    def __setitem__(self, key, value) -> None:
        self._write(key, self._checked(key, value))

    def _checked(self, key, value):
        """``value`` for ``entry[key] = value``, checked: the step count or a flat tensor; writes nothing."""
        rec = self._rec
        where = f"opt.state[{rec.name}][{key!r}]"
        if key not in self._keys:
            raise KeyError(f"{where}: full offload keeps {list(self._keys)} per parameter")
        self._guard(f"assigning {where}")
        return step_value(value, where, rec) if key == "step" else host_value(value, where, rec)

    def _write(self, key, checked) -> None:
        rec = self._rec
        with torch.no_grad():
            if key == "step":
                rec.set_step(checked)
                return
            flat = getattr(rec, key)
            if checked.data_ptr() != flat.data_ptr() or checked.device != flat.device:
                flat.copy_(checked)
            if key == "master":  # NOTE: the compute copy is always round(master)
                rec.master_from_weights = False
                write_compute_copies([rec])

    def __delitem__(self, key) -> None:
        raise TypeError(f"opt.state[{self._rec.name}][{key!r}] cannot be deleted: full offload's host state is fixed")

    def keys(self):
        return list(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def get(self, key, default=None):
        return self[key] if key in self._keys else default

    def items(self):
        return [(key, self[key]) for key in self._keys]

    def values(self):
        return [self[key] for key in self._keys]

    def __repr__(self) -> str:
        return f"StateEntry({self._rec.name}, step={self._rec.step}, keys={list(self._keys)})"


class NoState(Mapping):
    """``opt.state[p]`` of a parameter frozen at wrap time: empty, as torch's ``{}`` for a
    parameter it never stepped; it refuses state, which full offload would never step."""

    __slots__ = ()

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __setitem__(self, key, value) -> None:
        raise TypeError(f"opt.state[param][{key!r}]: this parameter was frozen (requires_grad=False) when the "
                        f"optimizer was wrapped, so full offload keeps no state for it")

    _checked = __setitem__  # StateMapping's assignment checks each key first: refused here

    def __repr__(self) -> str:
        return "NoState()"


class StateMapping(MutableMapping):
    """``opt.state``: ``{param: StateEntry}`` for every trainable parameter, built once; a
    frozen parameter of the groups reads as an empty ``NoState``, outside the mapping."""

    def __init__(self, records, guard: Callable[[str], None], read_guard: Callable[[str], None], frozen=()):
        self._entries = {rec.param: StateEntry(rec, guard, read_guard) for rec in records}
        self._frozen = set(frozen)  # NOTE: tensors hash by identity

    def __getitem__(self, param) -> StateEntry:
        try:
            return self._entries[param]
        except (KeyError, TypeError):
            pass
        if param in self._frozen:
            return NoState()
        raise KeyError("opt.state: not a parameter of this full-offload optimizer")

    def __setitem__(self, param, value) -> None:
        entry = self[param]
        if value is entry:  # Lightning assigns back what it read
            return
        if not isinstance(value, (Mapping, StateEntry)):
            raise TypeError(f"opt.state[param] must be set to a mapping of tensors, got {type(value).__name__}")
        # NOTE: every key is checked before any is written: a refused assignment changes
        # nothing, as load_state_dict.
        checked = [(key, entry._checked(key, value[key])) for key in value.keys()]
        for key, src in checked:
            entry._write(key, src)

    def __delitem__(self, param) -> None:
        self[param]
        raise TypeError("opt.state entries cannot be deleted: full offload's host state is fixed at construction")

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, param) -> bool:
        try:
            return param in self._entries
        except TypeError:
            return False

    def __reduce__(self):
        # NOTE: pickle, torch.save and copy.deepcopy of opt.state get what torch's would give: a
        # dict {param: {key: tensor}}, here a snapshot whose tensors are copies of the host state.
        return (dict, ([(param, {key: value.clone() for key, value in entry.items()})
                        for param, entry in self._entries.items()],))

    def __repr__(self) -> str:
        return f"StateMapping({len(self._entries)} parameters)"
