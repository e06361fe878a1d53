"""Sharded models: FSDP's DTensor parameters, and the state of a sharded run.

What is here: telling a sharded tensor or module apart without importing
``torch.distributed.tensor`` (a 3 s import that ``import hookloop`` must not pay); the
checkpoint layout a sharded model asks for (`set_layout`: ``"full"`` or ``"sharded"``);
its model and optimizer state, gathered in full or kept as shards, through
``torch.distributed.checkpoint.state_dict``; and placing a full tensor as the shard of
another one. `hookloop.callbacks.FSDP` shards the model and sets its layout; the run state
and the checkpoint files read and restore through these functions, so no other part of
hookloop asks whether the model is sharded.

A full optimizer state is written in the layout of ``optimizer.state_dict()`` (parameters
numbered in param-group order), so a file written under FSDP loads into an unsharded model
and optimizer as any other, and one written without FSDP resumes under it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hookloop.runfile.format import MODEL, OPTIMIZER, PARAM_GROUPS, PARAMS, STATE

__all__ = [
    "LAYOUTS",
    "full_optimizer_state",
    "gather",
    "gather_for_rank_zero",
    "grad_scaler",
    "is_distributed_module",
    "is_sharded_module",
    "repoint_optimizer",
    "contains_shards",
    "is_sharded_tensor",
    "layout_of",
    "load_full_model_state",
    "load_full_optimizer_state",
    "load_sharded_state",
    "model_state",
    "optimizer_state",
    "place_like",
    "check_optimizer_holds_model",
    "regather",
    "release",
    "replicated_like",
    "saves_shards",
    "set_layout",
    "sharded_targets",
]

#: The checkpoint layouts of a sharded model: one gathered file, or a directory of shards.
LAYOUTS = ("full", "sharded")
_layouts: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_gathered: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def is_sharded_tensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP's parameters and gradients).

    No DTensor can exist before its module is imported, so this imports nothing.

    Example:
        >>> is_sharded_tensor(torch.zeros(2))
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None)
    return kind is not None and isinstance(value, kind)


def contains_shards(value: Any) -> bool:
    """True when a DTensor is anywhere in ``value`` (dicts, lists and tuples searched).

    Example:
        >>> contains_shards({"model": {"w": torch.ones(1)}})
        False
    """
    kind = type(value)
    if kind is torch.Tensor or kind is int or kind is float:  # the leaves of most states
        return False
    if is_sharded_tensor(value):
        return True
    if isinstance(value, Mapping):
        return any(contains_shards(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_shards(item) for item in value)
    return False


def is_sharded_module(module: Any) -> bool:
    """True for a module ``torch.distributed.fsdp.fully_shard`` was applied to.

    Example:
        >>> is_sharded_module(torch.nn.Linear(2, 2))
        False
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return kind is not None and isinstance(module, kind)


def is_distributed_module(module: Any) -> bool:
    """True for a module that `is_sharded_module`, or that holds DTensor parameters (split
    by tensor parallelism): its state is read and loaded through DCP's state-dict helpers.

    Example:
        >>> is_distributed_module(torch.nn.Linear(2, 2))
        False
    """
    return is_sharded_module(module) or any(is_sharded_tensor(param)
                                            for param in module.parameters())


def check_optimizer_holds_model(owner: str, module: nn.Module,
                                optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Before a callback replaces ``module``'s parameters (sharding, tensor parallel): the
    names of the parameters by identity, once the optimizer was checked to hold only them
    and not to have stepped. Raises `ConfigurationError` otherwise."""
    from hookloop.errors import ConfigurationError

    if optimizer.state:
        raise ConfigurationError(
            f"{owner}: {type(optimizer).__name__} has stepped already (it holds state for the "
            "whole, unsharded parameters), so it cannot be re-pointed at the shards. "
            "Build the optimizer fresh before fit; Checkpoint(resume=...) restores its "
            "state into the sharded one.")
    names = {id(param): name for name, param in module.named_parameters()}
    foreign = [param for group in optimizer.param_groups for param in group[PARAMS]
               if id(param) not in names]
    if foreign:
        raise ConfigurationError(
            f"{owner}: the optimizer holds {len(foreign)} tensor(s) that are not parameters of "
            "the model (first of shape "
            f"{tuple(foreign[0].shape)}); {owner} replaces the model's parameters and re-points "
            "the optimizer at them, and the optimizer of such a model must hold only those. "
            "Give other parameters their own optimizer (Loop(..., state={...})).")
    return names


def repoint_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer,
                      names: dict[int, str]) -> None:
    """Point ``optimizer``'s param groups at ``module``'s current parameters, by the names
    `check_optimizer_holds_model` gave before they were replaced (class, hyper-parameters
    and groups kept: an optimizer still holding the old tensors would step nothing)."""
    by_name = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group[PARAMS] = [by_name[names[id(param)]] for param in group[PARAMS]]


def set_layout(module: nn.Module, layout: str | None) -> None:
    """Record how the checkpoints of the sharded ``module`` are laid out (None: forget it).

    ``"full"``: the state is gathered to rank 0 and written as one file; ``"sharded"``:
    every rank writes its shards into one directory.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> set_layout(model, "sharded"); layout_of(model)
        'sharded'
        >>> set_layout(model, None); layout_of(model) is None
        True
    """
    if layout is None:
        _layouts.pop(module, None)
    elif layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}.")
    else:
        _layouts[module] = layout


def layout_of(module: nn.Module) -> str | None:
    """The checkpoint layout `set_layout` recorded for ``module``, or None (not sharded)."""
    return _layouts.get(module)


def saves_shards(module: nn.Module) -> bool:
    """Whether the saves of ``module``'s run hold shards (DTensors): its recorded layout
    (`set_layout`), or, where none is recorded, whether it holds DTensor parameters placed
    by the user (`is_distributed_module`), which its ``state_dict`` gives as they are.

    Example:
        >>> saves_shards(torch.nn.Linear(2, 2))
        False
    """
    layout = layout_of(module)
    return layout == "sharded" if layout is not None else is_distributed_module(module)


def _parts(module: nn.Module) -> list[nn.Module]:
    """The submodules ``fully_shard`` was applied to, in ``modules()`` order (every rank's)."""
    return [part for part in module.modules() if is_sharded_module(part)]


def gather(module: nn.Module) -> None:
    """Gather every parameter of the sharded ``module`` on every rank, and keep them gathered
    until `release`: no forward all-gathers meanwhile, so ranks may run different numbers
    of forwards (validation over shards of unequal size). A collective.
    """
    parts = _parts(module)
    for part in parts:
        part.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    for part in parts:
        part.unshard()  # type: ignore[operator]
    _gathered.add(module)


def regather(module: nn.Module) -> None:
    """After weights were written into the shards of a `gather`-ed ``module`` (an EMA
    swapped in: reading the state dict gives back the shards): gather them again, so the
    forwards see them. A collective then; nothing for a module not gathered."""
    if module not in _gathered:
        return
    for part in _parts(module):
        part.reshard()  # type: ignore[operator]
        part.unshard()  # type: ignore[operator]


def release(module: nn.Module, reshard_after_forward: bool) -> None:
    """End a `gather`: free the gathered parameters, and let each block free them after its
    forward again (``reshard_after_forward``; the root keeps them from forward to backward,
    as torch does by default)."""
    for part in _parts(module):
        part.reshard()  # type: ignore[operator]
        part.set_reshard_after_forward(  # type: ignore[operator]
            reshard_after_forward and part is not module, recurse=False)
    _gathered.discard(module)


def grad_scaler(module: nn.Module, device_type: str, **settings: Any) -> torch.amp.GradScaler:
    """The GradScaler for ``module``: FSDP's sharded one for a sharded module (a step with an
    inf/NaN in any rank's shards is skipped on every rank), torch's otherwise.

    Example:
        >>> type(grad_scaler(torch.nn.Linear(2, 2), "cpu", enabled=False)).__name__
        'GradScaler'
    """
    if is_sharded_module(module):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **settings)
    return torch.amp.GradScaler(device_type, **settings)


def replicated_like(value: torch.Tensor, reference: Any) -> Any:
    """``value`` (the same on every rank) as a DTensor replicated over ``reference``'s mesh.

    For arithmetic between a plain tensor and sharded ones (a clipping factor).
    """
    from torch.distributed.tensor import DTensor, Replicate

    mesh = reference.device_mesh
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def place_like(value: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """A copy of ``value`` laid out as ``reference``: on its device, in ``dtype``, and, when
    ``reference`` is a shard (a DTensor), cut to this rank's shard without communication.

    ``value`` is the whole tensor (read from a full checkpoint), or a DTensor already.

    Example:
        >>> place_like(torch.ones(2, dtype=torch.float64), torch.zeros(2), torch.float32).dtype
        torch.float32
    """
    if not is_sharded_tensor(reference):
        return value.to(device=reference.device, dtype=dtype, copy=True)
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh, placements = reference.device_mesh, reference.placements  # type: ignore[attr-defined]
    if is_sharded_tensor(value):
        return value.redistribute(mesh, placements).to(dtype=dtype, copy=True)  # type: ignore[attr-defined]
    # Each rank cuts its own shard from its full copy (src_data_rank=None: no scatter), then
    # keeps a copy of the shard only, not a view holding the whole tensor alive.
    whole = distribute_tensor(value.to(device=reference.device, dtype=dtype), mesh, placements,
                              src_data_rank=None)
    return DTensor.from_local(whole.to_local().clone(), mesh, placements, run_check=False,
                              shape=whole.shape, stride=whole.stride())


def _options(**settings: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**settings)


def model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` as a checkpoint takes it.

    A sharded module gives, by its layout: ``"full"``: every tensor gathered, on rank 0's
    CPU (other ranks get ``{}``; a collective); ``"sharded"``: this rank's shards (DTensors).
    """
    layout = layout_of(module)
    if layout is None:
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if layout == "full":
        return get_model_state_dict(module, options=_options(full_state_dict=True,
                                                             cpu_offload=True))
    return get_model_state_dict(module)


def full_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names turned into ``optimizer.state_dict()``'s
    layout: parameters numbered 0, 1, ... in param-group order.

    Example:
        >>> by_name = {"state": {"b": {"m": 1}}, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}
        >>> full_optimizer_state(by_name)
        {'state': {1: {'m': 1}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}
    """
    numbers: dict[str, int] = {}
    groups = []
    for group in state.get(PARAM_GROUPS, []):
        groups.append({**group, PARAMS: [numbers.setdefault(name, len(numbers))
                                           for name in group[PARAMS]]})
    return {STATE: {numbers[name]: value for name, value in state.get(STATE, {}).items()},
            PARAM_GROUPS: groups}


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` as a checkpoint takes it (see `model_state`).

    A sharded module's ``"full"`` layout gives the state gathered on rank 0's CPU, numbered
    as ``optimizer.state_dict()`` numbers it (other ranks: no state, no groups);
    ``"sharded"`` gives the shards keyed by parameter name, which a load on another number
    of ranks can re-shard.
    """
    layout = layout_of(module)
    if layout is None:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if layout == "full":
        gathered = get_optimizer_state_dict(module, optimizer, options=_options(
            full_state_dict=True, cpu_offload=True))
        return full_optimizer_state(gathered) if gathered else {STATE: {}, PARAM_GROUPS: []}
    return get_optimizer_state_dict(module, optimizer)


def gather_for_rank_zero(value: Any, rank: int) -> Any:
    """``value`` with every DTensor in it gathered whole onto rank 0's CPU.

    For the callbacks' states in a ``"full"`` checkpoint (an EMA over shards). One
    collective per DTensor, in the same order on every rank, so every rank must call it;
    the other ranks get None in place of each DTensor (only rank 0 writes the file).
    """
    if is_sharded_tensor(value):
        whole = value.full_tensor()  # type: ignore[attr-defined]
        return whole.cpu() if rank == 0 else None
    if type(value) in (dict,) or isinstance(value, Mapping):
        return type(value)((key, gather_for_rank_zero(item, rank)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(gather_for_rank_zero(item, rank) for item in value)
    return value


def _named_parameters(module: nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in module.named_parameters()}


def load_full_model_state(module: nn.Module, weights: Mapping[str, Any]) -> None:
    """Load a full (gathered, or unsharded) state dict into the sharded ``module``: each rank
    keeps its shard of every tensor. Strict: missing or unexpected keys raise."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # This rank's shards (a ``"sharded"`` state taken in memory: a live peer's) load as such.
    full = not any(is_sharded_tensor(value) for value in weights.values())
    set_model_state_dict(module, dict(weights), options=_options(full_state_dict=full))


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                              state: Mapping[str, Any]) -> None:
    """Load an ``optimizer.state_dict()``-layout state (parameters numbered in param-group
    order, full tensors) into the optimizer of the sharded ``module``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if any(isinstance(key, str) for key in state[STATE]):  # shards keyed by name (in memory)
        optimizer.zero_grad(set_to_none=True)
        set_optimizer_state_dict(module, optimizer, dict(state))
        return
    names = _named_parameters(module)
    order = [names.get(id(param)) for group in optimizer.param_groups for param in group[PARAMS]]
    if None in order:
        raise KeyError("the optimizer holds parameters that are not the model's; a sharded "
                       "model's optimizer must hold only its parameters")
    groups = [{**group, PARAMS: [order[number] for number in group[PARAMS]]}
              for group in state[PARAM_GROUPS]]
    by_name: Any = {STATE: {order[int(number)]: value for number, value in state[STATE].items()},
               PARAM_GROUPS: groups}
    optimizer.zero_grad(set_to_none=True)  # torch fills a fresh state with a zero-grad step
    set_optimizer_state_dict(module, optimizer, by_name, options=_options(full_state_dict=True))


def sharded_targets(module: nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> dict[str, Any]:
    """What a directory of shards is read into: this rank's model state and optimizer state
    (``{"model": ..., "optimizer": {"state": ...}}``), keyed by parameter name.

    Works for an unsharded module too (the whole tensors are then read). A fresh
    optimizer's state is created first (torch takes a step with zero gradients and a zero
    learning rate: the weights do not move), so that there is something to read into.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    targets: dict[str, Any] = {MODEL: get_model_state_dict(module)}
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)  # the zero-grad step above needs no gradients
        targets[OPTIMIZER] = {STATE: get_optimizer_state_dict(module, optimizer)[STATE]}
    return targets


def load_sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                       targets: Mapping[str, Any], param_groups: list[Any] | None) -> None:
    """Apply `sharded_targets` once read: the model, and the optimizer with the saved
    ``param_groups`` (hyper-parameters, parameters by name)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(module, dict(targets[MODEL]))
    if optimizer is not None and param_groups is not None:
        set_optimizer_state_dict(module, optimizer, {STATE: dict(targets[OPTIMIZER][STATE]),
                                                     PARAM_GROUPS: list(param_groups)})
