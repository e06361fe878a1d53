"""Gradient helpers shared by callbacks: the parameters in the model's order, the total
norm and clipping by it (sharded DTensor gradients included), and advice on non-finite
weights."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hookloop.runfile.sharded import is_sharded_tensor, replicated_like

from hookloop.runfile.weights import non_finite_weights_advice  # its home since issue 34

__all__ = ["clip_grad_norm", "non_finite_weights_advice", "parameters_in_model_order",
           "total_norm", "unclippable"]


def parameters_in_model_order(model: nn.Module, optimizer: torch.optim.Optimizer
                              ) -> list[torch.Tensor]:
    """The parameters ``optimizer`` holds: those of ``model`` in the model's order, then any
    others in param-group order.

    The order a user's ``clip_grad_norm_(model.parameters(), ...)`` sums the norms in: the
    optimizer's groups (weight decay on or off) list the same tensors in another order,
    and a sum of floats in another order differs in its last bits.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> weights = [model[0].weight, model[1].weight]
        >>> biases = [model[1].bias, model[0].bias]
        >>> optimizer = torch.optim.SGD([{"params": biases}, {"params": weights}], lr=0.1)
        >>> [p.shape[0] for p in parameters_in_model_order(model, optimizer)]
        [2, 2, 1, 1]
    """
    held = {id(param): param for group in optimizer.param_groups for param in group["params"]}
    ordered = [param for param in model.parameters() if held.pop(id(param), None) is not None]
    return ordered + list(held.values())  # dicts keep the insertion (group) order


def unclippable(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """The names of the parameters among ``params`` whose gradients no norm can be taken of
    correctly: DTensors with a ``Partial`` placement (each rank holds a summand of the
    value, not a shard of it: their local norms combine to no norm of the sum).

    Example:
        >>> unclippable(torch.nn.Linear(2, 2), list(torch.nn.Linear(2, 2).parameters()))
        []
    """
    names = {id(param): name for name, param in model.named_parameters()}
    return [names.get(id(param), f"<parameter of shape {tuple(param.shape)}>")
            for param in params if is_sharded_tensor(param) and any(
                type(placement).__name__ == "Partial"
                for placement in param.placements)]  # type: ignore[attr-defined]


def _replicated_value(norm: torch.Tensor) -> torch.Tensor:
    """A norm of DTensor gradients as a plain tensor: its value, the same on every rank."""
    return norm.full_tensor() if is_sharded_tensor(norm) else norm  # type: ignore[attr-defined]


def _split(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    plain = torch.Tensor
    if all(type(tensor) is plain for tensor in tensors):  # gradients, unsharded: every step
        return [], list(tensors)
    sharded = [tensor for tensor in tensors if is_sharded_tensor(tensor)]
    return sharded, [tensor for tensor in tensors if not is_sharded_tensor(tensor)]


def _by_mesh(sharded: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """DTensors grouped by their device mesh (torch's norm refuses two meshes in one call),
    in the order the meshes first appear."""
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in sharded:
        groups.setdefault(id(tensor.device_mesh), []).append(tensor)  # type: ignore[attr-defined]
    return list(groups.values())


def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients taken as one vector, as a tensor (no host sync).

    The same number ``torch.nn.utils.clip_grad_norm_`` returns; works on torch >= 2.3
    (``torch.nn.utils.get_total_norm`` exists only from 2.6). Sharded gradients (FSDP's
    and tensor parallel's DTensors) count with all their shards: the result is the global
    norm, a plain tensor with the same value on every rank (every rank must call it).
    Gradients on several meshes (FSDP + tensor parallel: some parameters on the 2-D
    mesh, others on the data-parallel one) and plain ones are normed per mesh, and the
    per-mesh norms combined: exactly the norm of one vector of them all.

    Example:
        >>> float(total_norm([torch.tensor([3.0]), torch.tensor([4.0])]))
        5.0
    """
    grads = list(grads)
    if not grads:
        return torch.tensor(0.0)
    sharded, plain = _split(grads)
    meshes = _by_mesh(sharded) if sharded else []
    if len(meshes) + (1 if plain else 0) == 1:
        return _replicated_value(_norm(grads, norm_type))
    # torch refuses to mix meshes or plain and DTensor gradients in one norm: one norm per
    # kind, then the norm of those norms.
    parts = [_replicated_value(_norm(group, norm_type)) for group in meshes]
    if plain:
        parts.append(_norm(plain, norm_type))
    device = parts[-1].device
    return torch.linalg.vector_norm(torch.stack([part.to(device) for part in parts]), norm_type)


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` together to a total norm of at most ``max_norm``;
    return the total norm before clipping (a plain tensor, no host sync).

    ``torch.nn.utils.clip_grad_norm_`` itself, bit for bit, where it applies (all gradients
    plain, or all DTensors on one mesh: its norm then is the global one). Gradients of
    several kinds (a sharded model and extra parameters in the optimizer; FSDP + tensor
    parallel parameters on two meshes) are clipped by the norm of them all.

    Example:
        >>> param = torch.nn.Parameter(torch.zeros(2))
        >>> param.grad = torch.tensor([3.0, 4.0])
        >>> float(clip_grad_norm([param], 1.0)), [round(g, 4) for g in param.grad.tolist()]
        (5.0, [0.6, 0.8])
    """
    grads = [param.grad for param in params if param.grad is not None]
    sharded, plain = _split(grads)
    if not sharded or (not plain and len(_by_mesh(sharded)) == 1):
        return _replicated_value(torch.nn.utils.clip_grad_norm_(params, max_norm,
                                                                norm_type=norm_type))
    norm = total_norm(grads, norm_type)
    # The factor clip_grad_norm_ uses: max_norm / (norm + 1e-6), at most 1.
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in plain:
            grad.mul_(factor.to(grad.device))
        for grad in sharded:
            grad.mul_(replicated_like(factor.to(grad.device), grad))
    return norm


def _norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(grad, norm_type) for grad in grads]
    if len({norm.device for norm in norms}) > 1:
        norms = [norm.to(grads[0].device) for norm in norms]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)
