"""Choosing the blocks of a model that a wrapping callback treats one by one: `FSDP` shards
them, `ActivationCheckpointing` recomputes them. Both take the same ``wrap`` argument
(None, a set of module classes, or a callable ``module -> bool``), read here once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from hookloop.base.checks import check_that

__all__ = ["MIN_SHARE", "check_wrap", "chosen_blocks", "default_blocks"]

#: The share of the model's parameters a direct child must hold to be chosen on its own
#: by the default ``wrap``; smaller children stay with the root.
MIN_SHARE = 0.02
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: look inside

Wrap = Iterable[type[nn.Module]] | Callable[[nn.Module], bool] | None


def check_wrap(owner: str, wrap: Any) -> Any:
    """``wrap`` checked: None, a callable, or a frozenset of nn.Module classes.

    Example:
        >>> sorted(kind.__name__ for kind in check_wrap("FSDP", [nn.Linear]))
        ['Linear']
    """
    if wrap is None or (callable(wrap) and not isinstance(wrap, type)):
        return wrap
    kinds = list(wrap) if isinstance(wrap, (set, frozenset, list, tuple)) else None
    check_that(f"{owner} wrap", wrap, kinds is not None and all(
        isinstance(kind, type) and issubclass(kind, nn.Module) for kind in kinds),
        "None, a set of nn.Module classes or a callable module -> bool",
        hint="For example wrap={TransformerBlock}.")
    return frozenset(kinds or ())


def _candidates(module: nn.Module) -> Iterator[nn.Module]:
    """The direct children of ``module``, with the blocks of a ModuleList or ModuleDict (which
    never run a forward themselves, so wrapping them would do nothing) in their place."""
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            yield from _candidates(child)
        else:
            yield child


def default_blocks(model: nn.Module, min_share: float = MIN_SHARE) -> list[nn.Module]:
    """The blocks the default ``wrap`` chooses: every direct child holding at least
    ``min_share`` of the model's parameters (the blocks of a ModuleList or ModuleDict are
    direct children here), except a child sharing a parameter with the rest of the model
    (a tied embedding stays with the root, which holds both of its users).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
        ...                             torch.nn.Linear(64, 64))
        >>> [type(block).__name__ for block in default_blocks(model)]  # LayerNorm: 1.5%
        ['Linear', 'Linear']
    """
    total = sum(param.numel() for param in model.parameters())
    if total == 0:
        return []
    blocks = []
    for child in _candidates(model):
        inside = {id(param) for param in child.parameters()}
        held = sum(param.numel() for param in child.parameters())
        outside = {id(param) for name, param in model.named_parameters(remove_duplicate=False)
                   if id(param) in inside and not _belongs(model, child, name)}
        if held >= min_share * total and not outside:
            blocks.append(child)
    return blocks


def _belongs(model: nn.Module, child: nn.Module, name: str) -> bool:
    """True when the parameter ``name`` of ``model`` is reached through ``child``."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return any(owner is module for module in child.modules())


def chosen_blocks(model: nn.Module, wrap: Any) -> list[nn.Module]:
    """The submodules ``wrap`` chooses (children before their parents), the root apart.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
        >>> [type(block).__name__ for block in chosen_blocks(model, frozenset({nn.Linear}))]
        ['Linear', 'Linear']
    """
    if wrap is None:
        return default_blocks(model)
    if callable(wrap) and not isinstance(wrap, type):
        chosen = [module for module in model.modules() if module is not model and wrap(module)]
    else:
        kinds = tuple(wrap)
        chosen = [module for module in model.modules()
                  if module is not model and isinstance(module, kinds)]
    return chosen[::-1]  # modules() is pre-order: reversed, every child precedes its parent
