"""Gradient clipping by total norm or by value, once per optimizer step."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, cast

import torch

from hookloop.base.checks import check_number
from hookloop.callback import Callback
from hookloop.engine.grads import clip_grad_norm, parameters_in_model_order, total_norm, unclippable
from hookloop.errors import ConfigurationError

if TYPE_CHECKING:
    from hookloop.loop import Loop

_PLAIN = torch.Tensor  # a plain gradient's exact type (a DTensor's is a subclass)

__all__ = ["GradClip"]


class GradClip(Callback):
    """Clip gradients in ``before_step``: by total norm (``max_norm``) or by value (``max_value``).

    Runs once per optimizer step, on the accumulated gradients, after `AMP` has unscaled
    them (it must come after AMP in the list; the stack check enforces it). The parameters
    clipped are those of ``loop.optimizer``, taken in the model's order (those of
    ``loop.unwrapped_model`` first, as ``model.parameters()`` lists them, then any others in
    param-group order): so the result is bit for bit that of a hand-written
    ``clip_grad_norm_(model.parameters(), max_norm)``, whatever the order of the param
    groups (weight decay on, off). The pre-clip total norm (``norm_type``) is put in
    ``loop.state.grad_norm`` as a tensor on the device, with no host sync: loggers read it
    when they log. Clipping by value computes that norm too.

    Under `FSDP` the gradients are shards (DTensors): the norm is the global one, over every
    shard of every rank (the same value on every rank, and in ``grad_norm``), and every
    shard is scaled by it, as one process holding the whole model would. Under
    `TensorParallel` (alone or with FSDP) the parameters live on several meshes and some
    may stay plain: the norm is taken per mesh and the norms combined, which is exactly
    the norm of the whole. A parameter whose layout cannot be normed (a DTensor with a
    ``Partial`` placement) is refused at fit start, by name.

    When every parameter's ``.grad`` is None at a step (a detached graph, a frozen model),
    it warns once (``RuntimeWarning``) instead of silently clipping nothing, and
    ``grad_norm`` is 0; the check only reads ``.grad is None``, so it costs no device sync.

    Args:
        max_norm: Scale all gradients together so that their total norm is at most this
            (``torch.nn.utils.clip_grad_norm_``).
        max_value: Clamp every gradient element into ``[-max_value, max_value]``
            (``torch.nn.utils.clip_grad_value_``).
        norm_type: The p of the p-norm reported (and clipped, with ``max_norm``);
            ``float("inf")`` for the max norm.

    Raises:
        ConfigurationError: neither or both of ``max_norm`` and ``max_value``, or a
            non-positive limit.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1))]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[GradClip(max_norm=0.5)])
        >>> loop.fit(1).grad_norm.dim()
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        0
    """

    runs_after = {
        "AMP": "AMP unscales the gradients in before_step and clipping needs their true "
               "values (clipping scaled gradients clips nothing)",
    }

    def __init__(self, max_norm: float | None = None, *, max_value: float | None = None,
                 norm_type: float = 2.0) -> None:
        if (max_norm is None) == (max_value is None):
            raise ConfigurationError(
                "GradClip max_norm and max_value must be exactly one given (max_norm clips the "
                "total norm, e.g. GradClip(1.0); max_value clamps each element, e.g. "
                f"GradClip(max_value=0.5)), got max_norm={max_norm!r}, max_value={max_value!r}.")
        self.max_norm = check_number("GradClip max_norm", max_norm, above=0, optional=True)
        self.max_value = check_number("GradClip max_value", max_value, above=0, optional=True)
        # Not check_number: float('inf') (the max norm) is a norm_type too.
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or \
                math.isnan(norm_type) or not (norm_type > 0 or math.isinf(norm_type)):
            raise ConfigurationError(
                f"GradClip norm_type must be a positive number or float('inf'), got "
                f"{norm_type!r}. It is the p of the p-norm: 2.0 is the usual Euclidean norm, "
                "which is what 'fro' means for a vector.")
        self.norm_type = float(norm_type)
        self._warned_no_grad = False
        self._order: tuple[tuple[int, int], list[torch.Tensor]] | None = None

    def __repr__(self) -> str:
        if self.max_norm is not None:
            return f"GradClip(max_norm={self.max_norm})"
        return f"GradClip(max_value={self.max_value})"

    def on_fit_start(self, loop: Loop) -> None:
        # After every setup: FSDP re-points the optimizer at the sharded parameters there.
        self._order = None
        refused = unclippable(loop.unwrapped_model, self._parameters(loop))
        if refused:
            raise ConfigurationError(
                f"GradClip cannot clip {', '.join(refused[:5])}: these parameters are DTensors "
                "with a Partial placement (each rank holds a summand, not a shard), so no norm "
                "of their gradients is the norm of the whole. Place them as Shard or Replicate "
                "in the tensor-parallel plan (or leave them out of it), or drop GradClip.")

    def _parameters(self, loop: Loop) -> list[torch.Tensor]:
        """The optimizer's parameters in the model's order, worked out once per fit (and
        again if the optimizer's groups change)."""
        key = (id(loop.optimizer), sum(len(group["params"]) for group in loop.optimizer.param_groups))
        if self._order is None or self._order[0] != key:
            self._order = (key, parameters_in_model_order(loop.unwrapped_model, loop.optimizer))
        return self._order[1]

    def before_step(self, loop: Loop) -> None:
        """Record the pre-clip total norm in ``loop.state.grad_norm``, then clip."""
        params = self._parameters(loop)
        if self.max_norm is not None and params and all(type(param.grad) is _PLAIN
                                                      for param in params):
            # Every gradient there and a plain tensor (the usual step): `clip_grad_norm`'s
            # own first case, torch's clip itself, without reading the gradients twice more.
            loop.state.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm,
                                                                  norm_type=self.norm_type)
            return
        params = [param for param in params if param.grad is not None]
        if not params:  # only `.grad is None` was read: no sync
            # Nothing to clip (clip_grad_value_ would raise on an empty list): norm 0.
            loop.state.grad_norm = torch.zeros((), device=loop.device)
            self._warn_no_grad(loop)
            return
        if self.max_norm is not None:
            loop.state.grad_norm = clip_grad_norm(params, self.max_norm, self.norm_type)
        else:
            grads = [param.grad for param in params if param.grad is not None]  # all of them
            loop.state.grad_norm = total_norm(grads, self.norm_type)
            torch.nn.utils.clip_grad_value_(params, cast(float, self.max_value))

    def _warn_no_grad(self, loop: Loop) -> None:
        if self._warned_no_grad:
            return
        self._warned_no_grad = True
        warnings.warn(
            f"GradClip: at step {loop.state.step} every parameter of loop.optimizer has .grad "
            "None, so there is nothing to clip (grad_norm is 0) and the optimizer step changes "
            "nothing. Likely causes: the loss does not depend on the optimized parameters (a "
            "graph detached by .detach(), .item(), .numpy() or torch.no_grad() in the forward), "
            "a frozen model (requires_grad=False), or an optimizer built on other parameters "
            "than the model's. (Warned once.)", RuntimeWarning, stacklevel=4)
