"""Gradient helpers shared by callbacks: the total norm, the gradients in the model's order."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["total_norm", "non_finite_weights_advice"]


def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients taken as one vector, as a tensor (no host sync).

    The same number ``torch.nn.utils.clip_grad_norm_`` returns; works on torch >= 2.3
    (``torch.nn.utils.get_total_norm`` exists only from 2.6).

    Example:
        >>> float(total_norm([torch.tensor([3.0]), torch.tensor([4.0])]))
        5.0
    """
    grads = list(grads)
    if not grads:
        return torch.tensor(0.0)
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(grad, norm_type) for grad in grads]
    if len({norm.device for norm in norms}) > 1:
        norms = [norm.to(grads[0].device) for norm in norms]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def non_finite_weights_advice(callbacks: Sequence[Any]) -> str:
    """What to tell a user whose weights became non-finite, given the stack they run.

    For `Checkpoint`'s "weights are not finite" warning: advise adding `TerminateOnNaN`
    only when it is not there already.

    Example:
        >>> non_finite_weights_advice([])[:24]
        'Add TerminateOnNaN() to '
    """
    # By class name, as ordering constraints name classes: the core imports no callback.
    present = [callback for callback in callbacks
               if any(cls.__name__ == "TerminateOnNaN" for cls in type(callback).__mro__)]
    if not present:
        return ("Add TerminateOnNaN() to stop before a non-finite loss or gradient reaches "
                "the weights.")
    if not getattr(present[0], "check_gradients", True):
        return ("TerminateOnNaN(check_gradients=False) only watches the loss; a finite loss "
                "with non-finite gradients passed it. Use TerminateOnNaN() to check both.")
    return ("TerminateOnNaN is in the stack and saw finite losses and gradients, so the "
            "optimizer step itself (a learning rate or eps that overflows), a callback that "
            "writes the weights, or weights that were non-finite from the start made them so.")
