# Checkpoints of full offload: the optimizer state in torch's optimizer-state
# format, keyed like the wrapped optimizer, with the fp32 masters added. The
# moments are saved in the dtype they are stored in (fp32 or bf16, state_dtype)
# and loaded from either: copied into the stored dtype, rounded to nearest even
# exactly as ``.to(torch.bfloat16)`` when that is bf16.
#
# Scope: ``state`` views, ``state_dict()`` and ``load_state_dict()`` of
# FullCPUOffloadOptimizer; for FSDP2 the tensors are DTensors over the host
# shards, so torch.distributed.checkpoint saves and loads them per rank.
# Non-goals: the accumulators (a checkpoint is taken between steps), converting
# checkpoints of other optimizers' formats beyond a plain torch AdamW one.

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Optional

import torch

from cpu_offload._common.checks import item_of
from cpu_offload._full.host_state import take_changed_elements, write_compute_copies
from cpu_offload._full.options import read_hparams
from cpu_offload._full.state_mapping import HOST_STATE_KEPT, MASTER_STEP, host_value, saved_entry, step_value

__all__ = ["state_dict", "load_state_dict", "SPECULATION_KEY", "LATE_HPARAMS_KEY", "CLIP_LIMIT_KEY"]

# NOTE: the factor the next step speculates with (the last step's clipping coefficient and
# late scale_grads_ factors), and whether the last step's hyper-parameters were set after its
# last backward began (then the next step does not speculate), and the 2-norm the last step
# was clipped to (past it, the next step's chunks wait for their factor), decide which bits a
# redo produces, so a resume is bit-identical only with them. Saved in every param group (one
# value per optimizer): torch.distributed's get_optimizer_state_dict keeps group keys but
# drops other top-level keys; never written into the live groups.
SPECULATION_KEY = "speculation_factor"
LATE_HPARAMS_KEY = "late_hyperparameters"
CLIP_LIMIT_KEY = "clip_limit"


def state_dict(opt, *, host_state: bool = True) -> dict:
    """torch's optimizer ``state_dict`` layout plus ``"master"`` per parameter.

    Tensors are the live state, as torch returns its live state tensors (the step counts
    too: ``step`` is ``opt.state[p]["step"]``'s tensor, ``master_step`` one of its own kept
    equal to the count); clone them to keep a snapshot. ``host_state=False``: the groups alone,
    marked ``HOST_STATE_KEPT`` (for a framework's device round trip, state_mapping.py).

    NOTE: plain dicts: torch DCP's in-place load (``_init_state_dict``) replaces
    any other mapping by None.
    """
    groups = []
    index = 0
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        packed[SPECULATION_KEY] = opt._validator.predicted
        packed[LATE_HPARAMS_KEY] = opt._validator.predicted_late_hparams
        packed[CLIP_LIMIT_KEY] = opt._validator.clip_limit
        if not host_state:
            packed[HOST_STATE_KEPT] = True
        index += len(group["params"])
        groups.append(packed)
    if not host_state:
        return {"state": {}, "param_groups": groups}
    state = {rec.index: dict(saved_entry(rec)) for rec in opt._records}
    state.update(opt._frozen_entries)
    return {"state": state, "param_groups": groups}


def _validate_groups(opt, saved_groups) -> None:
    if not isinstance(saved_groups, (list, tuple)):
        raise ValueError("state_dict['param_groups'] must be a list of dicts")
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, the optimizer has {len(opt.param_groups)}")
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), (list, tuple)):
            raise ValueError(f"state_dict['param_groups'][{g}] must be a dict with a list 'params'")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"state_dict param_groups[{g}] has {len(saved['params'])} parameters, the optimizer has {len(group['params'])}"
            )
    # The options the groups would hold once loaded, checked as every step checks them (a torch
    # AdamW checkpoint may carry amsgrad=True, which full offload cannot honour).
    loaded = [{**group, **_group_options(saved)} for saved, group in zip(saved_groups, opt.param_groups)]
    try:
        read_hparams(loaded, opt._algorithm, bf16_moments=opt._bf16_moments)
    except (TypeError, ValueError) as e:
        raise type(e)(f"state_dict: {e}") from None


def _group_options(saved: dict) -> dict:
    """The options of a saved group that load_state_dict writes into the live one."""
    return {k: v for k, v in saved.items()
            if k not in ("params", "param_names", SPECULATION_KEY, LATE_HPARAMS_KEY, CLIP_LIMIT_KEY, HOST_STATE_KEPT)}


def _validate(opt, sd: dict) -> tuple:
    """Check the whole state_dict against the optimizer before anything is written.

    Returns ``([(rec, step, {key: flat host tensor})], stale, frozen)``; an entry missing from
    ``state`` (never stepped in the saved run) gives step 0, zero moments and
    the current master. ``stale``: ``(rec, master step, step)`` of the entries whose
    master is left out, as it belongs to another step count than the entry's. ``frozen``:
    the saved entries of parameters frozen at wrap time, kept as they are (torch keeps a
    frozen parameter's state), for ``state_dict()`` to save again.

    NOTE: torch's optimizers keep state keys they do not know: a full-offload checkpoint
    resumed without offload (a torch AdamW, or offload="optimizer") is saved again with
    its masters as they were and the steps taken since, and a partial load in place
    (torch.distributed.checkpoint's allow_partial_load) leaves the template's masters.
    The master's own step count tells such a master from the step's; without it (an older
    checkpoint) the master is taken.
    """
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups'")
    saved_groups, state = sd["param_groups"], sd["state"]
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict['state'] must be a dict {{parameter id: entry}}, got {type(state).__name__}")
    _validate_groups(opt, saved_groups)
    saved_ids = [i for saved in saved_groups for i in saved["params"]]  # saved id of our index k
    moments = ("exp_avg", "exp_avg_sq") if opt._algorithm == "adamw" else ()
    plan, stale = [], []
    for rec in opt._records:
        saved_id = saved_ids[rec.index]
        entry = state.get(saved_id, state.get(str(saved_id)))
        if entry is None:  # never stepped in the saved run: step 0, the weights decide the master
            plan.append((rec, 0, {}))
            continue
        where = f"state_dict['state'][{saved_id}]"
        if not isinstance(entry, dict) or "step" not in entry:
            raise ValueError(f"{where} ({rec.name}) has no 'step'")
        tensors = {}
        for key in ("master",) + moments:
            if key in entry:
                tensors[key] = host_value(entry[key], f"{where}['{key}']", rec)
            elif key != "master":
                raise ValueError(f"{where} ({rec.name}) has no '{key}'")
        step = step_value(entry["step"], f"{where}['step']", rec)
        if "master" in tensors and MASTER_STEP in entry:
            master_step = step_value(entry[MASTER_STEP], f"{where}['{MASTER_STEP}']", rec)
            if master_step != step:
                del tensors["master"]
                stale.append((rec, master_step, step))
        plan.append((rec, step, tensors))
    frozen_ids = {id(p) for p in opt._frozen}
    params = [p for group in opt.param_groups for p in group["params"]]
    frozen = {}
    for index, p in enumerate(params):
        entry = state.get(saved_ids[index], state.get(str(saved_ids[index])))
        if id(p) in frozen_ids and isinstance(entry, dict):
            frozen[index] = dict(entry)
    return plan, stale, frozen


def _saved_once(saved_groups, key: str, default, check):
    """The value every saved group holds for ``key`` (``default``: a checkpoint of a version
    without it, or of torch.optim.AdamW), as ``check(value, name)`` returns it from each group
    (raising ValueError naming the group and key); a one-element tensor is read as its number."""
    values = set()
    for g, saved in enumerate(saved_groups):
        name = f"state_dict param_groups[{g}]['{key}']"
        values.add(check(item_of(name, saved.get(key, default)), name))
    if len(values) != 1:
        raise ValueError(f"state_dict param_groups disagree on '{key}': {sorted(values, key=repr)}")
    (value,) = values
    return value


def _factor(factor, name: str) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {factor!r}")
    return float(factor)


def _flag(late, name: str) -> bool:
    if not isinstance(late, bool):
        raise ValueError(f"{name} must be True or False, got {late!r}")
    return late


def _limit(limit, name: str) -> Optional[float]:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0):
        raise ValueError(f"{name} must be None or a number >= 0, got {limit!r}")
    # NOTE: inf (no limit) was saved after a clip that only measured the norm
    return None if limit is None or math.isinf(limit) else float(limit)


def _speculation(saved_groups) -> tuple:
    """The saved speculation factor, late-hyper-parameter flag and clipping limit, checked."""
    # NOTE: each group's value is checked before they are compared: a NaN in every group is a
    # bad value, not groups that disagree (NaN != NaN), and a value that cannot be hashed is named
    return (_saved_once(saved_groups, SPECULATION_KEY, 1.0, _factor),
            _saved_once(saved_groups, LATE_HPARAMS_KEY, False, _flag),
            _saved_once(saved_groups, CLIP_LIMIT_KEY, None, _limit))


def _load_groups(opt, saved_groups) -> None:
    for saved, group in zip(saved_groups, opt.param_groups):
        # NOTE: in place, as LR schedulers hold these dicts; the values deep-copied, as torch's
        # load_state_dict copies them: a tensor lr that a scheduler fills in place stays ours.
        group.update(copy.deepcopy(_group_options(saved)))


def load_state_dict(opt, sd: dict) -> None:
    """Restore masters, moments, step counts and group options; refresh the
    device compute copy from the restored masters. All or nothing: the whole
    state_dict is checked before anything is written.

    An entry without ``"master"`` (a plain torch AdamW state_dict) takes its
    master from the parameter's current values (kept when those are just the
    rounded master: the master is the more precise copy of them). Moments of
    either float dtype load into the stored one (``copy_`` converts).
    """
    if isinstance(sd, dict) and isinstance(sd.get("param_groups"), (list, tuple)) and \
            any(isinstance(g, dict) and g.get(HOST_STATE_KEPT) for g in sd["param_groups"]):
        _validate_groups(opt, sd["param_groups"])
        _load_groups(opt, sd["param_groups"])  # the host state stayed where it is
        return
    plan, stale, frozen = _validate(opt, sd)
    factor, late, limit = _speculation(sd["param_groups"])
    rounded = []  # trained entries without a master whose weights were loaded at the compute dtype
    with torch.no_grad():
        for rec, step, tensors in plan:
            rec.set_step(step)  # NOTE: the loaded count replaces an edit not taken
            for key in ("exp_avg", "exp_avg_sq"):
                flat = getattr(rec, key)
                if flat is not None and key not in tensors:
                    flat.zero_()
            if "master" not in tensors:  # the weights decide, where they are not round(master)
                current = rec.local().detach().reshape(-1).to(rec.master.device)
                if take_changed_elements(rec, current):  # nonzero values taken from the weights
                    rec.master_from_weights = current.dtype != torch.float32
                # NOTE: also a master that took such values before (a state_dict() read takes
                # weights loaded since wrapping): it has no more bits than they have
                if step and rec.master_from_weights:
                    rounded.append(rec)
            else:
                rec.master_from_weights = False
            for key, src in tensors.items():
                flat = getattr(rec, key)
                if src.data_ptr() != flat.data_ptr():  # DCP may have loaded into our own views
                    flat.copy_(src)
        _load_groups(opt, sd["param_groups"])
        write_compute_copies(opt._records)
    opt._frozen_entries = frozen
    opt._validator.predicted = factor
    opt._validator.predicted_late_hparams = late
    opt._validator.clip_limit = limit
    if rounded:
        dtype = str(rounded[0].local().dtype).replace("torch.", "")
        warnings.warn(
            f"cpu_offload: the state of {[r.name for r in rounded][:8]} has no fp32 master (a checkpoint written without "
            f"full offload), and their weights changed since wrapping (a model checkpoint loaded into the {dtype} "
            f"model): their masters start from those {dtype} values, without the low bits of fp32 weights. To resume "
            "at fp32 precision, load the fp32 weights into the model before wrapping it", RuntimeWarning,
            stacklevel=opt._validator.stacklevel())
    if stale:
        rec, master_step, step = stale[0]
        warnings.warn(
            f"cpu_offload: the masters of {[r.name for r, *_ in stale][:8]} were saved at step {master_step}, but their "
            f"state's step count is {step} (for {rec.name}): an optimizer without full offload stepped the weights since "
            "and kept the masters as they were, or the checkpoint has no masters (a torch optimizer's, loaded with "
            "torch.distributed.checkpoint into opt.state_dict(), whose masters it left). They were not loaded: the "
            "model's current weights are the masters (load the model's weights of the same checkpoint first)",
            RuntimeWarning,
            stacklevel=opt._validator.stacklevel())
