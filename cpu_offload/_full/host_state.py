# Host-side optimizer state for full offload: one record per trainable
# parameter, the flat host buffers (fp32 masters and accumulators; moments in
# fp32 or bf16), the host RAM check, and the in-place cast of the model's
# parameters to their compute dtype.
#
# Scope: construction-time bookkeeping shared by optimizer.py, pipeline.py
# and checkpoint.py.
# Non-goals: anything that runs per step (pipeline.py), checkpoint formats
# (checkpoint.py).

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Optional

import psutil
import torch

from cpu_offload._common.dtensor import as_dtensor_like, is_dtensor, local_of

__all__ = [
    "ParamRecord", "HostBuffers", "collect_records", "check_fsdp_not_started", "check_fsdp_uniform_dtypes",
    "host_bytes_needed", "available_host_ram", "check_host_ram", "allocate_host_state", "cast_param", "cast_to_compute",
    "restore_dtypes", "note_versions", "check_moved_storage", "take_changed_elements", "adopt_external_weights",
    "adopt_edits_before_step", "take_masters_written_in_place",
    "write_compute_copies", "show_steps",
]

# Elements per 64-byte line of fp32: every per-parameter view starts aligned.
_ALIGN_ELEMS = 16

# The integer dtype of each compute dtype's width, to compare values bit for bit.
_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@dataclass(eq=False)
class ParamRecord:
    """Everything full offload keeps about one trainable parameter.

    ``index`` is the parameter's position in the wrapped optimizer's
    ``state_dict`` numbering (all groups, in order), so checkpoints are keyed
    like the wrapped optimizer's.
    """

    index: int
    group: int
    name: str
    param: torch.nn.Parameter
    numel: int
    shape: torch.Size
    is_dtensor: bool
    master: Optional[torch.Tensor] = None  # fp32 flat host view
    exp_avg: Optional[torch.Tensor] = None  # m, flat host view in the state dtype (AdamW)
    exp_avg_sq: Optional[torch.Tensor] = None  # v, flat host view in the state dtype (AdamW)
    accum: Optional[torch.Tensor] = None  # fp32 flat host view (grad_accum_steps > 1)
    step: int = 0  # completed optimizer steps: grows exactly when the master changed
    # the master took nonzero values from weights changed outside the optimizer at the compute
    # dtype (a bf16 model checkpoint loaded after wrapping): they lack an fp32 checkpoint's low bits
    master_from_weights: bool = False
    # The step count as the user sees it (torch's ``state["step"]``): live 0-d float32 tensors,
    # made when first handed out, given ``step`` by ``show_step`` (state_mapping.py)
    step_tensor: Optional[torch.Tensor] = field(default=None, repr=False)  # opt.state's and state_dict()'s "step"
    step_view: object = field(default=None, repr=False)  # ``step_tensor``'s memory as a 0-d numpy array
    master_step_ref: Optional[weakref.ref] = field(default=None, repr=False)  # state_dict()'s "master_step"
    shown_step: int = 0  # the count they were last given
    shown_value: float = 0.0  # ``step_tensor``'s value then (float32): another value is the user's edit
    # The master as handed out (opt.state[p]["master"], state_dict()'s): [the flat master it shows,
    # the tensor, its local tensor, their version counters when the weight was last written from it]
    shown_master: Optional[list] = field(default=None, repr=False)
    version: Optional[tuple] = None  # the compute copy's version counters and storage when the library last wrote it
    holds_grad: bool = False  # torch would hold a (zero) .grad for it: got one, not zeroed with set_to_none
    on_device: bool = False  # its state lives on the device and is stepped there (device_state.py)
    # Per accumulation window (reset when the window closes):
    has_accum: bool = False  # ``accum`` holds the sum of this window's grads so far
    arrived: int = -1  # micro-batch index of the last gradient seen
    pieces_total: int = 0  # pieces of this window's optimizer step (0: not stepped)
    pieces_done: int = 0  # of which the worker has stepped; step += 1 when all are done
    uncounted: bool = False  # a kernel changed pieces of this window whose chunk then failed, uncounted
    grad_sq: float = 0.0  # squared 2-norm of the window's (local) gradient, when norms are tracked
    retained: Optional[torch.Tensor] = None  # without accumulation: the window's gradient, kept for a redo
    hook: object = field(default=None, repr=False)
    # The C++ tensor the hook was registered on (``param._cdata``): torch.utils.swap_tensors
    # gives the parameter another one, without the hook (and without its Python attributes)
    hooked_tensor: int = 0
    cast_from: Optional[torch.dtype] = None  # the dtype full offload cast the parameter from

    def local(self) -> torch.Tensor:
        """The device tensor holding the compute copy (looked up each time: FSDP2
        may replace the local tensor object when it re-pads)."""
        return local_of(self.param) if self.is_dtensor else self.param

    # NOTE: the window's step count moves only through these methods: the pipeline plans a
    # step in pieces, the worker marks each piece stepped (the step counts with the last
    # one), a rollback undoes it.
    def plan_step(self, pieces: int) -> None:
        """This window's optimizer step comes in ``pieces`` pieces, none stepped yet."""
        self.pieces_total, self.pieces_done = pieces, 0

    def piece_stepped(self) -> None:
        """One more piece was stepped (worker thread); the last one counts the step."""
        self.pieces_done += 1
        if self.pieces_done == self.pieces_total:
            self.step += 1

    @property
    def stepped(self) -> bool:
        """Every piece of this window's step was stepped: the step counted."""
        return self.pieces_total > 0 and self.pieces_done == self.pieces_total

    @property
    def torn(self) -> bool:
        """Some pieces of this window's step were stepped, not all, or a chunk failed after
        its kernel changed pieces of this parameter (their master matches no whole step)."""
        return self.uncounted or 0 < self.pieces_done < self.pieces_total

    def undo_step(self) -> None:
        """The stepped pieces were rolled back: the step no longer counts."""
        if self.stepped:
            self.step -= 1
        self.pieces_done = 0

    # NOTE: the user-visible count is written on the training thread only, where ``step`` is
    # still (never from the worker's piece_stepped): at the end of step(), when a landing
    # window lands, and where a load or an assignment sets it. An edit of ``step_tensor``
    # (any value other than ``shown_value``) is the user's, taken by the optimizer
    # (state_mapping.step_edits) before the count is next used.
    def live_step(self) -> torch.Tensor:
        """The step count as one live 0-d float32 tensor (made at the first call)."""
        if self.step_tensor is None:
            # NOTE: made outside inference mode whatever the caller's (an evaluation that reads
            # the state): an inference tensor could not be updated by the steps after it
            with torch.inference_mode(False):
                self.step_tensor = torch.tensor(float(self.step), dtype=torch.float32)
            # NOTE: read and written through numpy, about 0.04 us against fill_'s 0.7 us: every
            # step() reads and writes each count handed out
            self.step_view = self.step_tensor.numpy()
            self.shown_step, self.shown_value = self.step, float(self.step_view)
        return self.step_tensor

    def live_master_step(self) -> torch.Tensor:
        """The count the master belongs to, as a live 0-d float32 tensor apart from ``live_step()``'s
        (a torch optimizer that loads a checkpoint steps ``step`` in place and leaves this one,
        checkpoint.py): the one handed out before while it is held, else a new one."""
        self.live_step()  # NOTE: gives shown_step its value the first time
        master_step = None if self.master_step_ref is None else self.master_step_ref()
        if master_step is None:
            with torch.inference_mode(False):  # NOTE: as live_step's
                master_step = torch.tensor(float(self.shown_step), dtype=torch.float32)
            self.master_step_ref = weakref.ref(master_step)
        return master_step

    def step_edited(self) -> bool:
        """The live step tensor was written since the library last gave it the count."""
        return self.step_tensor is not None and float(self.step_view) != self.shown_value

    def show_step(self, *, over_edit: bool = False) -> None:
        """The live tensors <- the count, where it changed since they were given it. An edit of
        the step tensor not taken yet stays (the count the next step takes), unless ``over_edit``
        (a load, an assignment, an edit taken or undone)."""
        if self.step_tensor is None or (not over_edit and (self.step == self.shown_step or self.step_edited())):
            return
        value = float(self.step)
        self.step_view[()] = value
        master_step = None if self.master_step_ref is None else self.master_step_ref()
        if master_step is not None:
            master_step.fill_(value)
        self.shown_step, self.shown_value = self.step, float(self.step_view)

    def live_master(self) -> torch.Tensor:
        """The master as handed out: one tensor while the master stays where it is (torch's state
        tensors are the state), over the master's memory with version counters of its own, so a
        write into it or into a view of it is seen (``master_written``).

        NOTE: a view of ``master`` would share the counter of the whole host buffer, which the
        library's own writes move (a rollback, a load: they write through ``master``)."""
        shown = self.shown_master
        if shown is None or shown[0] is not self.master:  # NOTE: gpu_state="auto" may move the state once
            flat = self.master
            with torch.inference_mode(False):  # NOTE: as live_step's (an inference tensor keeps no version)
                local = torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
                    flat.untyped_storage(), flat.storage_offset(), self.shape, flat.view(self.shape).stride())
                tensor = as_dtensor_like(local, self.param)
            self.shown_master = shown = [flat, tensor, local, None]
            shown[3] = _versions(shown)
        return shown[1]

    def master_written(self) -> bool:
        """The master handed out was written in place since the weight was last written from it."""
        shown = self.shown_master
        return shown is not None and _versions(shown) != shown[3]

    def note_master(self) -> None:
        """The weight was written from the master: what was written into the one handed out is taken."""
        shown = self.shown_master
        if shown is not None:
            shown[3] = _versions(shown)

    def set_step(self, count: int) -> None:
        """A count loaded, assigned or written in place becomes the count, shown as it is."""
        self.step = count
        self.show_step(over_edit=True)

    def reset_window(self) -> None:
        self.has_accum = False
        self.uncounted = False
        self.arrived = -1
        self.pieces_total = self.pieces_done = 0
        self.grad_sq = 0.0


def _versions(shown_master: list) -> tuple:
    """The version counters of the master handed out: the tensor's and its local shard's."""
    return shown_master[1]._version, shown_master[2]._version


def collect_records(optimizer: torch.optim.Optimizer) -> tuple[list[ParamRecord], list[torch.nn.Parameter]]:
    """Records for trainable parameters, plus the frozen ones (left untouched)."""
    records: list[ParamRecord] = []
    frozen: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError(f"parameter param_groups[{g}]['params'][{i}] appears twice in the optimizer")
            seen.add(id(p))
            name = names[i] if names is not None else f"param_groups[{g}][{i}]"
            if not p.requires_grad:
                frozen.append(p)
                index += 1
                continue
            if not p.is_floating_point():
                raise TypeError(f"parameter {name} has dtype {p.dtype}; full offload needs floating-point parameters")
            if p.dtype == torch.float64:
                raise TypeError(f"parameter {name} is float64: full offload steps fp32 masters, which would round its "
                                "values, in float32, where torch steps it in float64; convert the model with "
                                "model.float() first, or use offload=\"optimizer\"")
            loc = local_of(p)
            if loc.is_meta:
                raise ValueError(f"parameter {name} is on the meta device and has no values: materialize the model "
                                 "first (model.to_empty(device=...) and initialize or load its weights), then wrap")
            if not loc.is_contiguous():
                raise ValueError(f"parameter {name} is not contiguous; full offload copies whole parameters as flat ranges")
            records.append(
                ParamRecord(index, g, name, p, loc.numel(), loc.shape, is_dtensor(p))
            )
            index += 1
    if not records:
        raise ValueError("optimizer has no trainable parameters (requires_grad=True) to offload")
    devices = {r.local().device for r in records}
    if len(devices) != 1:
        raise ValueError(f"full offload needs all trainable parameters on one device, got {sorted(map(str, devices))}")
    _check_no_shared_memory(records)
    _check_no_grads(records)
    return records, frozen


def _check_no_grads(records: list[ParamRecord]) -> None:
    """Raise if a parameter holds a non-zero gradient (a backward before wrapping, no zero_grad()).

    NOTE: full offload takes each gradient from backward's hooks; one left in ``.grad`` keeps
    the dtype of the weights before the cast, and autograd would add the next gradient to it.
    Zero ones (``zero_grad(set_to_none=False)``) are taken at the end of construction."""
    held = [rec.name for rec in records
            if rec.param.grad is not None and bool(local_of(rec.param.grad).detach().count_nonzero())]
    if held:
        raise ValueError(f"parameters {held[:8]}{' ...' if len(held) > 8 else ''} hold a gradient (param.grad) when "
                         "offload_optimizer wraps their optimizer; full offload takes gradients from backward and "
                         "keeps none in .grad: call zero_grad() before wrapping")


def _check_no_shared_memory(records: list[ParamRecord]) -> None:
    """Raise if two parameters overlap in memory (``b.data = a.data``).

    NOTE: torch steps both through the one memory; here each gets its own master and its
    compute copy its own storage at the cast, which would untie them. Views of one buffer
    that do not overlap are fine."""
    spans = []
    for rec in records:
        loc = rec.local()
        if loc.numel():
            start = loc.data_ptr()
            spans.append((start, start + loc.numel() * loc.element_size(), rec.name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"parameters {first} and {second} share memory: full offload gives each parameter "
                             "its own fp32 master and compute copy, which would untie them; tie them as one "
                             "Parameter (module.b.weight = module.a.weight), or give each its own storage")


def check_fsdp_not_started(records: list[ParamRecord]) -> None:
    """Raise if an FSDP2 module owning one of the parameters already ran forward.

    FSDP2 fixes each parameter's dtype and all-gather buffers at its lazy init
    (the first forward); a cast after that would not reach the all-gather.
    NOTE: this reads FSDP2 internals; if they change, the check is skipped and
    the gradient dtype check in the hook still fails loudly.
    """
    owned = {id(r.param): r for r in records if r.is_dtensor}
    if not owned:
        return
    started = [owned[id(p)] for params in _fsdp_param_groups(started=True) for p in params if id(p) in owned]
    if started:
        raise RuntimeError(
            f"parameter {started[0].name} belongs to an FSDP2 module that already ran a forward pass; FSDP2 "
            "fixes parameter dtypes at its first forward, so call offload_optimizer(..., offload='full') "
            "after fully_shard() and before the first forward"
        )


def check_fsdp_uniform_dtypes(records: list[ParamRecord], *, compute_dtype: torch.dtype, keep_fp32: set[int]) -> None:
    """Raise if the casts ``cast_to_compute`` would leave the trainable parameters of one
    FSDP2 parameter group in two dtypes: FSDP2 requires them to share one and fails at its
    first forward ("FSDP expects uniform original parameter dtype"), naming neither option.
    Frozen parameters may differ (a frozen fp32 base beside trained weights), and groups
    holding none of ``records`` are not this wrap's.
    NOTE: reads FSDP2 internals, as ``check_fsdp_not_started``."""
    owned = {id(r.param): r for r in records if r.is_dtensor}
    if not owned:
        return
    for params in _fsdp_param_groups(started=False):
        if not any(id(p) in owned for p in params):
            continue
        dtypes = {}
        for p in params:
            if not p.requires_grad:
                continue
            target = p.dtype if id(p) not in owned else torch.float32 if id(p) in keep_fp32 else compute_dtype
            dtypes.setdefault(target, owned[id(p)].name if id(p) in owned else f"a parameter of shape {tuple(p.shape)}")
        if len(dtypes) > 1:
            (a, name_a), (b, name_b) = sorted(dtypes.items(), key=str)[:2]
            raise ValueError(
                f"the trainable parameters of one FSDP2 group would be left in two dtypes ({a} and {b}: {name_a} in "
                f"{a}, {name_b} in {b}), and FSDP2 requires one dtype among them; give the parameters kept in "
                "float32 (keep_fp32) a fully_shard of their own, or keep the whole group in one dtype")


def _fsdp_param_groups(*, started: bool):
    """The sharded parameters of each FSDP2 parameter group alive (only those whose module
    ran its first forward if ``started``); nothing where FSDP2's internals differ."""
    try:
        from torch.distributed._composable_state import _module_state_mapping

        states = [ref() for ref in list(_module_state_mapping.values())]
        found = []
        for state in states:
            if state is None or (started and getattr(state, "_is_root", None) is None):
                continue
            groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: several per module
            if groups is None:
                single = getattr(state, "_fsdp_param_group", None)
                groups = [single] if single is not None else []
            found += [[fp.sharded_param for fp in group.fsdp_params] for group in groups if group is not None]
    except Exception:  # pragma: no cover - other torch versions
        return []
    return found


@dataclass(eq=False)
class HostBuffers:
    master: torch.Tensor
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    accum: Optional[torch.Tensor]
    retained: list = field(default_factory=list)  # per compute dtype, without accumulation

    @property
    def nbytes(self) -> int:
        bufs = [self.master, self.exp_avg, self.exp_avg_sq, self.accum, *self.retained]
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)


def _padded(n: int) -> int:
    return (n + _ALIGN_ELEMS - 1) // _ALIGN_ELEMS * _ALIGN_ELEMS


def host_bytes_needed(records: list[ParamRecord], *, moments: bool, accumulate: bool,
                      state_dtype: torch.dtype = torch.float32, grad_itemsize=lambda rec: 2) -> int:
    """Bytes of the host buffers: fp32 master, two moments in ``state_dtype``, and either
    an fp32 accumulator or a copy of the gradient (``grad_itemsize(rec)`` bytes per element)."""
    total = sum(_padded(r.numel) for r in records)
    per_elem = 4 + (2 * state_dtype.itemsize if moments else 0) + (4 if accumulate else 0)
    retained = 0 if accumulate else sum(_padded(r.numel) * grad_itemsize(r) for r in records)
    return total * per_elem + retained


def available_host_ram() -> int:
    return psutil.virtual_memory().available


def check_host_ram(needed: int, pinned: int, available: int, why: str = "") -> None:
    """Raise a MemoryError naming the bytes when ``needed + pinned`` exceed ``available``
    (the caller's reading of available_host_ram()); ``why`` ends the message."""
    if needed + pinned > available:
        gib = 1024**3
        raise MemoryError(
            f"full offload needs {needed + pinned} bytes of host RAM ({(needed + pinned) / gib:.2f} GiB: "
            f"{needed} for masters/moments/accumulators, {pinned} pinned staging) but only "
            f"{available} bytes ({available / gib:.2f} GiB) are available{why}"
        )


def allocate_host_state(records: list[ParamRecord], *, moments: bool, accumulate: bool,
                        state_dtype: torch.dtype = torch.float32, pin: bool = False) -> HostBuffers:
    """Allocate flat buffers (masters and accumulators fp32, moments in
    ``state_dtype``; page-locked with ``pin``) and give each record its views; copy the
    masters.

    NOTE: the caller binds the process to its CPU set before this runs, so the
    first touch below (the zero fill and the master copy) places the pages on
    the NUMA node of the threads that will update them. Views start at a
    multiple of 16 elements (64 bytes of fp32, 32 of bf16); the kernels need
    no alignment.
    """
    total = sum(_padded(r.numel) for r in records)
    master = torch.empty(total, dtype=torch.float32, pin_memory=pin)
    exp_avg = torch.zeros(total, dtype=state_dtype, pin_memory=pin) if moments else None
    exp_avg_sq = torch.zeros(total, dtype=state_dtype, pin_memory=pin) if moments else None
    accum = torch.zeros(total, dtype=torch.float32, pin_memory=pin) if accumulate else None
    off = 0
    for r in records:
        sl = slice(off, off + r.numel)
        r.master = master[sl]
        with torch.no_grad():
            r.master.copy_(r.local().detach().reshape(-1))  # fp32 master <- current values
        r.exp_avg = exp_avg[sl] if moments else None
        r.exp_avg_sq = exp_avg_sq[sl] if moments else None
        r.accum = accum[sl] if accumulate else None
        off += _padded(r.numel)
    return HostBuffers(master, exp_avg, exp_avg_sq, accum)


def allocate_retained(records: list[ParamRecord], host: HostBuffers) -> None:
    """Without accumulation: a host copy of each window's gradient in its compute dtype
    (rollback and redo read it), one flat buffer per dtype. Call after the cast."""
    by_dtype: dict = {}
    for r in records:
        by_dtype.setdefault(r.local().dtype, []).append(r)
    for dtype, recs in by_dtype.items():
        flat = torch.zeros(sum(_padded(r.numel) for r in recs), dtype=dtype)
        off = 0
        for r in recs:
            r.retained = flat[off : off + r.numel]
            off += _padded(r.numel)
        host.retained.append(flat)


def cast_param(rec: ParamRecord, target: torch.dtype) -> None:
    """Cast one parameter in place (same Python object) to ``target``."""
    if rec.param.dtype == target:
        return
    with torch.no_grad():
        if rec.is_dtensor:
            # NOTE: a DTensor keeps its local shard in a Python attribute that
            # ``.data =`` does not touch; swapping the whole tensor (what
            # ``nn.Module.to`` does for tensor subclasses) keeps the Parameter
            # object, so FSDP2's lazy init picks up the new local shard.
            new = torch.nn.Parameter(rec.param.detach().to(target), requires_grad=rec.param.requires_grad)
            try:
                torch.utils.swap_tensors(rec.param, new)
            except RuntimeError as e:
                raise RuntimeError(
                    f"could not cast FSDP2 parameter {rec.name} to {target} in place ({e}); "
                    "wrap the optimizer before the model's first forward"
                ) from e
        else:
            rec.param.data = rec.param.data.to(target)


def cast_to_compute(records: Iterable[ParamRecord], *, compute_dtype: torch.dtype, keep_fp32: set[int],
                    originals: dict) -> None:
    """Cast each parameter in place to its compute dtype; parameters whose ``id``
    is in ``keep_fp32`` become (or stay) fp32. Records ``{id(param): original dtype}``
    in ``originals`` before each cast: the caller's, so that whatever stops the casts
    (an error, a Ctrl-C, even on this function's last line) leaves it knowing what to
    restore (``restore_dtypes``)."""
    for r in records:
        target = torch.float32 if id(r.param) in keep_fp32 else compute_dtype
        if r.param.dtype != target:
            originals[id(r.param)] = r.param.dtype
            cast_param(r, target)


def restore_dtypes(records: Iterable[ParamRecord], originals: dict) -> None:
    """Undo ``cast_to_compute``: each cast parameter gets its master's values
    (the exact values it had before the cast) in its original dtype."""
    for r in records:
        if id(r.param) in originals:
            cast_param(r, originals[id(r.param)])
            with torch.no_grad():
                r.local().view(-1).copy_(r.master)


def _version_of(rec: ParamRecord) -> tuple:
    """What changes when the compute copy is written: its version counters, its storage
    and its dtype (last).

    NOTE: an in-place op on an FSDP2 parameter (a DTensor: ``p.mul_``, the ``copy_`` of
    ``model.load_state_dict``) runs on the local shard below autograd, which leaves the
    shard's version counter as it was: only the DTensor's own counter moves.
    """
    local = rec.local()
    return rec.param._version, local._version, local.data_ptr(), local.dtype


def check_moved_storage(records: list[ParamRecord]) -> None:
    """Raise as construction does (``_check_no_shared_memory``) when a compute copy moved to
    memory that overlaps another parameter's since the library last wrote it (``b.data =
    a.data[:n]``): each master would be written back over the other's weights.

    NOTE: checked over every record, and only once a storage moved: each call reads every
    record's pointer, which the version check reads anyway."""
    if any(rec.version is not None and rec.local().data_ptr() != rec.version[2] for rec in records):
        _check_no_shared_memory(records)


def note_versions(records: Iterable[ParamRecord]) -> None:
    """Remember each compute copy's version counters and storage after the library wrote it."""
    for rec in records:
        rec.version = _version_of(rec)


def _external_change(rec: ParamRecord) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The compute copy's values (flat, on the master's device) and where they differ from
    round(master), when they were changed outside the optimizer since the library last
    wrote them, else None.

    NOTE: a changed version counter or storage alone is not a change of values
    (FSDP2 re-pads its shards at its first forward): it counts only when the compute
    copy differs from round(master), and is noted as seen otherwise.
    """
    version = _version_of(rec)
    if version == rec.version:
        return None
    if version[-1] != rec.version[-1]:
        # NOTE: taken for new weights, the cast compute copies would replace the masters
        # by their rounded values (model.float()), or fail in the kernels (half, double).
        raise TypeError(
            f"the compute copy of {rec.name} is now {version[-1]}, but full offload keeps it in "
            f"{rec.version[-1]}: the model was cast after offload_optimizer wrapped it (model.float(), "
            f".half(), .to(dtype)); cast it back (model.to({rec.version[-1]})), or cast before wrapping")
    if tuple(rec.local().shape) != tuple(rec.shape):
        raise ValueError(
            f"the compute copy of {rec.name} now has shape {tuple(rec.local().shape)}, but full offload keeps it at "
            f"shape {tuple(rec.shape)} (its master and moments): the parameter was replaced through `.data =` by a "
            "tensor of another shape; give it back its shape, or build the optimizer for the new one")
    if not rec.local().is_contiguous():
        raise ValueError(
            f"the compute copy of {rec.name} is no longer contiguous (strides {rec.local().stride()}): its memory "
            "format was changed after offload_optimizer wrapped it (model.to(memory_format=torch.channels_last)), "
            "and full offload copies parameters as flat ranges; keep the parameters contiguous "
            "(model.to(memory_format=torch.contiguous_format)): channels_last inputs work with them")
    current = rec.local().detach().reshape(-1).to(rec.master.device)
    changed = _changed_elements(rec, current)
    if not changed.any():
        rec.version = version
        return None
    return current, changed


def _changed_elements(rec: ParamRecord, current: torch.Tensor) -> torch.Tensor:
    """Where ``current`` (the compute copy, flat, on the master's device) differs from
    round(master) in its bits: a sign flipped at zero and a NaN's payload count."""
    bits = _SAME_WIDTH_INT[current.dtype]
    return current.view(bits) != rec.master.to(current.dtype).view(bits)


def _is_mask(current: torch.Tensor, changed: torch.Tensor) -> bool:
    """Every changed element of ``current`` is ±0 and some unchanged one is not."""
    return not current[changed].any() and bool(current[~changed].any())


def take_changed_elements(rec: ParamRecord, current: torch.Tensor, changed: Optional[torch.Tensor] = None) -> bool:
    """The master takes ``current`` (exactly, as fp32 holds every bf16 value): all of it when
    over half of its elements changed (``changed``: where they differ from round(master),
    computed when None) to anything but a mask, else only those, the others keeping their
    fp32 bits. A mask sets every changed element to ±0 and keeps some nonzero one (pruning).
    Returns whether nonzero values were taken (they lack the low bits of fp32 weights).

    NOTE: an edit of part of a weight (a padding row zeroed after each step,
    nn.Embedding(max_norm=...) renormalising the rows it looks up, a pruning mask) would
    otherwise round every master of the tensor at each edit; a load of other weights changes
    nearly every element, and the few that happen to equal round(master) are the loaded
    values too."""
    changed = _changed_elements(rec, current) if changed is None else changed
    if 2 * int(changed.sum()) > changed.numel() and not _is_mask(current, changed):
        rec.master.copy_(current)
        return bool(current.any())
    torch.where(changed, current, rec.master, out=rec.master)
    return bool(current[changed].any())


def adopt_external_weights(records: Iterable[ParamRecord]) -> None:
    """Weights changed outside the optimizer (``model.load_state_dict``, an
    in-place edit, ``.data =``) win over stale masters: whole when over half of a tensor
    changed to anything but a mask, else element by element (``take_changed_elements``)."""
    for rec in records:
        change = _external_change(rec)
        if change is not None:
            if take_changed_elements(rec, *change):
                rec.master_from_weights = change[0].dtype != torch.float32
            rec.version = _version_of(rec)


def adopt_edits_before_step(records: Iterable[ParamRecord]) -> list[ParamRecord]:
    """step() begins: a record whose window step has not run yet takes an edit made since the
    library last wrote its weights (``adopt_external_weights``): its step updates the edited
    weight, as torch's step() would. Returns the records whose step already ran during backward
    and whose weights were changed since: those cannot be stepped from the edit.

    NOTE: a record counts as not stepped while none of its pieces ran (a short window, a
    window that holds its chunks back, a step rolled back by the non-finite guard).
    """
    late = []
    for rec in records:
        if rec.pieces_done == 0:
            adopt_external_weights([rec])
        elif _external_change(rec) is not None:
            late.append(rec)
    return late


def take_masters_written_in_place(records: list[ParamRecord]) -> list[ParamRecord]:
    """A backward begins: each master written in place since its weight was last written from
    it (``ParamRecord.master_written``) is taken, the weight <- round(master). Returns those
    whose weight was not round(master) already: the forward that ran read another weight.

    NOTE: a master and its weight loaded in place together (torch DCP's load into a model's
    and an optimizer's state dicts) agree, and read as no such case. A weight tied to another
    one, cast, reshaped or made non-contiguous since the library wrote it raises first, as it
    would without the write (writing it would note it as the library's)."""
    written = [rec for rec in records if rec.master_written()]
    if written:
        check_moved_storage(records)
    stale = []
    for rec in written:
        _external_change(rec)  # NOTE: for its checks only
        current = rec.local().detach().reshape(-1).to(rec.master.device)
        if _changed_elements(rec, current).any():
            stale.append(rec)
        rec.note_master()
    write_compute_copies(stale)
    return stale


def write_compute_copies(records: Iterable[ParamRecord]) -> None:
    """Each record's compute copy <- round(master), rounded where the master lives; note the versions."""
    records = list(records)
    with torch.no_grad():
        for rec in records:
            local = rec.local()
            local.detach().view(-1).copy_(rec.master.to(local.dtype))
            rec.note_master()
    note_versions(records)


def show_steps(records: Iterable[ParamRecord]) -> None:
    """The live step tensors handed out <- their record's count (ParamRecord.show_step)."""
    for rec in records:
        if rec.step_tensor is not None:
            rec.show_step()
