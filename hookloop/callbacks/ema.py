"""Exponential moving average of the weights, updated on the device without host syncs."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hookloop.callback import Callback
from hookloop.base.checks import (
    check_choice,
    check_flag,
    check_int,
    check_name,
    check_number,
)
from hookloop.base.compat import foreach_copy_, foreach_lerp_
from hookloop.base.modules import unwrap
from hookloop.base.phase import Phase
from hookloop.errors import ConfigurationError
from hookloop.runfile.sharded import is_sharded_tensor, place_like, regather

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["EMA"]

_BUFFER_MODES = ("average", "copy")
_VALIDATE = ("ema", "model", "both")
#: What a validation that every callback sees keeps of the loop's state across the second pass.
_BATCH_FIELDS = ("batch_idx", "batch", "outputs", "loss", "targets", "batch_size")


def _entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> live tensor for everything in ``module.state_dict()`` (params and buffers)."""
    return {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
            if isinstance(tensor, torch.Tensor)}


def _is_one(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


class EMA(Callback):
    """Keep an exponential moving average of the model's weights; validate with it.

    At the first fit start the shadow is the model's weights (``ema = theta_0``); after
    every ``every_n_steps``-th real optimizer step (counted on ``loop.state.step``, so
    steps skipped by the GradScaler or cancelled never count) it becomes
    ``ema = decay_t * ema + (1 - decay_t) * theta``, computed as one fused lerp (`hookloop.base.compat.foreach_lerp_`)
    on the device: no host sync (``torch.optim.swa_utils.AveragedModel`` syncs once per
    update). The decay of the ``t``-th averaging update (``t = 0, 1, ...``, counted in
    ``updates`` and checkpointed) is::

        decay_t = min(decay, (1 + t) / (10 + t))   # warmup=True (default)
        decay_t = decay                             # warmup=False

    Why warmup is on by default: validation, ``best.pt`` and ``EarlyStopping`` read the
    averaged weights by default, and with a constant ``decay=0.999`` the average after 100
    updates is still ``0.999**100 = 90%`` the initial weights, so every early validation
    would score the untrained model. With the warmup the first update keeps 10% of the
    average (``decay_0 = 0.1``), the 90th (``t = 89``) keeps 91%, and the decay reaches ``decay`` after
    ``(10 * decay - 1) / (1 - decay)`` updates (8990 for 0.999, 890 for 0.99). This is
    the step-dependent decay of TensorFlow's ``ExponentialMovingAverage(num_updates=...)``.
    The decay is computed on the host from the Python counter, so it costs no sync.

    ``start_step``: until the optimizer step ``start_step`` the shadow just follows the
    weights (it is a copy of them after every step, so a validation then sees the training
    weights); the average starts from the weights at step ``start_step`` and the first
    averaging update is at the next due step, with ``t = 0``. ``start_step=0`` starts from
    the weights at fit start, as above.

    The shadow covers every entry of the unwrapped model's ``state_dict()``:

    * floating-point parameters and buffers are kept in float32 on the device of the
      tensor they shadow, whatever the training dtype (half-precision averages round
      updates away);
    * buffers: with ``buffers="average"`` (default) floating buffers such as BatchNorm
      running statistics are averaged like the weights, matching averaged weights with
      averaged statistics (timm's ModelEmaV2 does the same); ``buffers="copy"`` copies the
      model's current buffers instead. Integer buffers (``num_batches_tracked``) are always
      copied, in their own dtype.

    Later ``fit`` calls continue the average. Its placement is decided at fit start, after
    the model moved and a resumed run's state was loaded, so a shadow loaded from a CPU
    checkpoint goes to the model's device. Keys are the unwrapped model's names (no
    ``module.`` from DDP, no ``_orig_mod.`` from ``torch.compile``), so the state loads
    whatever the wrapping, and ``model.load_state_dict(ema.averaged_state_dict())`` works.

    Which weights validate (``validate``): ``"ema"`` (default, the same as
    ``validate_with_ema=True``): the whole validation pass (its events included) runs with
    the EMA weights swapped into the model, and the training weights are restored after,
    also on an exception. A checkpoint written inside validation (a best checkpoint saved
    at ``on_validation_end``) therefore holds the EMA weights in its model entry; every
    checkpoint also holds the shadow under this callback's state key. ``"model"`` (the
    same as ``validate_with_ema=False``): the model's own weights. ``"both"`` (timm's
    training script validates both every epoch): each validation of ``fit`` runs with the
    model's weights, giving ``val_loss`` and the usual metrics, which monitors and
    ``best.pt`` read as they are; then, at this callback's
    ``on_validation_end``, once more over the same data with the EMA weights, as
    ``loop.evaluate(val_data, prefix="ema_val")``: ``ema_val_loss``, ``ema_val_acc``...
    in ``loop.state.metrics`` and the history row, for the callbacks after this one
    (``EarlyStopping("ema_val_loss")`` goes after it: the stack check says so). That second
    pass changes no random stream, so the training is the same as with ``"ema"``.

    Args:
        decay: The weight of the old average, in [0, 1) (the limit of ``decay_t``; 1.0 would
            never update it).
        every_n_steps: Update after every n-th optimizer step.
        warmup: Use ``decay_t = min(decay, (1 + t) / (10 + t))``; False: ``decay`` always.
        start_step: The optimizer step whose weights the average starts from (>= 0).
        validate_with_ema: Swap the EMA weights in for validation (``validate`` says more).
        validate: ``"ema"``, ``"model"`` or ``"both"`` (see above); None: ``"ema"`` when
            ``validate_with_ema``, else ``"model"``.
        buffers: ``"average"`` or ``"copy"`` (see above).
        name: State key, to keep two EMAs (e.g. two decays) apart.

    Raises:
        ConfigurationError: a decay outside [0, 1), a bad ``every_n_steps``, ``start_step``,
            ``warmup``, ``buffers``, ``name``, a ``validate_with_ema`` that is not a bool, a
            ``validate`` that is not one of its values or contradicts
            ``validate_with_ema=False``.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        >>> ema = EMA(decay=0.9)
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu", callbacks=[ema])
        >>> _ = loop.fit(2)
        hookloop: training ended at epoch 2/2, step 8: all 2 epochs are done.
        >>> averaged = ema.averaged_model()   # a copy of the model with the EMA weights
        >>> with ema.swapped(model):          # or swap them into the model for a while
        ...     predictions = model(torch.randn(2, 4))
    """

    def __init__(self, decay: float = 0.999, *, every_n_steps: int = 1,
                 validate_with_ema: bool = True, buffers: str = "average",
                 warmup: bool = True, start_step: int = 0, name: str | None = None,
                 validate: str | None = None) -> None:
        never_moves = ("decay=1.0 would never move the average: it would stay the weights at fit "
                       "start, and validation would score those forever.")
        self.decay = check_number("EMA decay", decay, minimum=0, below=1,
                                  hint=never_moves if _is_one(decay) else "A usual decay is 0.999.")
        self.every_n_steps = check_int("EMA every_n_steps", every_n_steps)
        with_ema = check_flag("EMA validate_with_ema", validate_with_ema)
        if validate is not None:
            check_choice("EMA validate", validate, _VALIDATE,
                         hint="'ema': the EMA weights validate; 'model': the model's; 'both': "
                              "each validation runs with both (metrics of the second ema_*).")
            if not with_ema and validate != "model":
                raise ConfigurationError(
                    f"EMA validate={validate!r} contradicts validate_with_ema=False (the same "
                    "as validate='model'): give one of them, validate='model', 'ema' or "
                    "'both'.")
        #: Which weights validate: ``"ema"``, ``"model"`` or ``"both"``.
        self.validate = validate or ("ema" if with_ema else "model")
        self.validate_with_ema = self.validate == "ema"  # the main pass swaps the EMA weights
        self._second_pass = False  # inside the "both" pass with the EMA weights
        self.buffers = check_choice("EMA buffers", buffers, _BUFFER_MODES)
        self.warmup = check_flag("EMA warmup", warmup)
        self.start_step = check_int("EMA start_step", start_step, minimum=0,
                                    hint="It is the optimizer step the average starts from.")
        self.name = check_name("EMA name", name)
        #: Number of averaging updates made so far (``t`` of the warmup; checkpointed).
        self.updates = 0
        self._shadow: dict[str, torch.Tensor] | None = None
        self._model: nn.Module | None = None
        # Cached per fit: (shadows, sources) to lerp in float32, and to copy.
        self._lerp: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copy: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def __repr__(self) -> str:
        extra = "" if self.warmup else ", warmup=False"
        extra += f", start_step={self.start_step}" if self.start_step else ""
        extra += f", name={self.name!r}" if self.name else ""
        return f"EMA(decay={self.decay}{extra})"

    # ------------------------------------------------------------------ shadow
    def _build(self, model: nn.Module) -> None:
        """Create the shadow for ``model`` from its weights, or place the existing one."""
        entries = _entries(model)
        source = self._shadow
        if source is not None:
            missing = [name for name in entries if name not in source]
            unexpected = [name for name in source if name not in entries]
            if missing or unexpected:
                raise ConfigurationError(
                    f"The EMA state does not fit the model: missing {missing[:5]}, unexpected "
                    f"{unexpected[:5]}. Load an EMA state saved from this model's architecture.")
        shadow: dict[str, torch.Tensor] = {}
        by_tensor: dict[int, torch.Tensor] = {}  # tied weights share one shadow tensor
        for name, tensor in entries.items():
            if id(tensor) in by_tensor:
                shadow[name] = by_tensor[id(tensor)]
                continue
            value = (source[name] if source is not None else tensor).detach()
            dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
            if value.shape != tensor.shape:
                raise ConfigurationError(
                    f"The EMA state for {name!r} has shape {tuple(value.shape)} but the model's "
                    f"is {tuple(tensor.shape)}. Load an EMA state saved from this model.")
            if source is not None and value.device == tensor.device and value.dtype == dtype \
                    and is_sharded_tensor(value) == is_sharded_tensor(tensor):
                placed = value  # an existing shadow already in place: keep the same tensor
            else:  # under FSDP, a whole tensor (a full checkpoint's) cut to this rank's shard
                placed = place_like(value, tensor, dtype)
            by_tensor[id(tensor)] = shadow[name] = placed
        self._shadow = shadow
        self._model = model
        self._group(model, entries, shadow)

    def _group(self, model: nn.Module, entries: dict[str, torch.Tensor],
               shadow: dict[str, torch.Tensor]) -> None:
        """Sort each tensor once (tied ones share a shadow) into the update it gets: a
        float32 lerp, a lerp through a float32 copy, or a plain copy (integer buffers, and
        float buffers with ``buffers="copy"``)."""
        lerp_shadows, lerp_sources, casts, copy_shadows, copy_sources = [], [], [], [], []
        params = {id(param) for param in model.parameters()}
        seen: set[int] = set()
        for name, tensor in entries.items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            is_param = id(tensor) in params
            if tensor.is_floating_point() and (is_param or self.buffers == "average"):
                if tensor.dtype == torch.float32:
                    lerp_shadows.append(shadow[name])
                    lerp_sources.append(tensor.detach())
                else:
                    casts.append((shadow[name], tensor.detach()))
            else:
                copy_shadows.append(shadow[name])
                copy_sources.append(tensor.detach())
        self._lerp = (lerp_shadows, lerp_sources)
        self._casts = casts
        self._copy = (copy_shadows, copy_sources)

    def _require_shadow(self) -> dict[str, torch.Tensor]:
        shadow = self._shadow
        if shadow is None:
            raise RuntimeError(
                "EMA has no averaged weights yet: they are created when fit starts. Run "
                "loop.fit(...) first, or load_state_dict(...) a saved EMA state.")
        return shadow

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        """Create the shadow (``ema = theta_0``) or place a loaded one on the model's device;
        with ``validate="both"``, refuse a producer of ``val_*`` metrics listed after this
        callback: the EMA's pass (in this ``on_validation_end``) would run before that one
        computed the model's values, and leave it the EMA's."""
        if self.validate == "both":
            later = loop.callbacks[loop.callbacks.index(self) + 1:]
            late = [type(callback).__name__ for callback in later if not isinstance(callback, EMA)
                    and any(name.startswith("val_") for name in callback.produces(loop))]
            if late:
                raise ConfigurationError(
                    f"EMA(validate='both') runs its second validation, with the EMA weights, "
                    f"at its on_validation_end, but {', '.join(late)} after it in the list "
                    "computes its val_* metrics at its own, afterwards: they would be the "
                    f"EMA's values. List EMA after {', '.join(late)}.")
        self._build(loop.unwrapped_model)

    def after_step(self, loop: Loop) -> None:
        """Average after every ``every_n_steps``-th real step; device ops only."""
        step = loop.state.step
        if step <= self.start_step:  # not started: follow the weights, start from step's
            self._follow()
            return
        if step % self.every_n_steps:
            return
        self.update()

    def current_decay(self) -> float:
        """The decay the next `update` uses: ``min(decay, (1 + t) / (10 + t))`` with the
        warmup, ``t = updates``; ``decay`` without.

        Example:
            >>> ema = EMA(0.999)
            >>> ema.current_decay()
            0.1
            >>> ema.updates = 90
            >>> round(ema.current_decay(), 4)
            0.91
        """
        if not self.warmup:
            return self.decay
        t = self.updates
        return min(self.decay, (1.0 + t) / (10.0 + t))

    # _follow and update run after every step without torch.no_grad(): every tensor they
    # touch is detached (the sources) or never required grad (the shadow), so autograd
    # records nothing, and entering a grad-mode context costs more than the lerp itself.
    def _follow(self) -> None:
        """Before ``start_step``: the shadow is a copy of the current weights."""
        shadows, sources = self._lerp
        if shadows:
            foreach_copy_(shadows, sources)
        for shadow, source in self._casts:
            shadow.copy_(source)
        copy_shadows, copy_sources = self._copy
        if copy_shadows:
            foreach_copy_(copy_shadows, copy_sources)

    def update(self) -> None:
        """One averaging update from the current weights (the callback calls it itself)."""
        weight = 1.0 - self.current_decay()  # host arithmetic on a Python int: no sync
        shadows, sources = self._lerp
        if shadows:
            foreach_lerp_(shadows, sources, weight)
        for shadow, source in self._casts:
            shadow.lerp_(source.float(), weight)
        copy_shadows, copy_sources = self._copy
        if copy_shadows:
            foreach_copy_(copy_shadows, copy_sources)
        self.updates += 1

    def validation_context(self, loop: Loop) -> AbstractContextManager[Any] | None:
        """Swap the EMA weights in for the validation pass (``validate="ema"``), or for the
        second pass of ``validate="both"``."""
        if self._shadow is None or not (self.validate_with_ema or self._second_pass):
            return None
        return self.swapped(loop.unwrapped_model)

    def produces(self, loop: Loop | None) -> Iterable[str]:
        """With ``validate="both"``: ``ema_val_loss`` and ``ema_`` before each ``val_*``
        metric the other callbacks produce (``ema_val_acc``): its pass writes them."""
        if self.validate != "both":
            return ()
        others = [callback for callback in getattr(loop, "callbacks", ())
                  if not isinstance(callback, EMA)]
        return ["ema_val_loss", *(f"ema_{name}" for callback in others
                                  for name in callback.produces(loop) if name.startswith("val_"))]

    def on_validation_end(self, loop: Loop) -> None:
        """``validate="both"``: after a validation of the fit with the model's weights, the
        same data again with the EMA weights, as ``ema_val_*``."""
        state = loop.state
        if self.validate != "both" or self._shadow is None or loop.phase is not Phase.VALIDATE:
            return  # not the sanity check, nor an evaluate() pass (this one's own included)
        self._second_pass = True
        try:  # the callbacks after this one see the val pass's last batch, as without it
            with state.kept(*_BATCH_FIELDS):
                loop.evaluate(cast(Iterable[Any], loop.val_data), prefix="ema_val")
        finally:
            self._second_pass = False

    # --------------------------------------------------------------- public API
    @torch.no_grad()
    def copy_to(self, module: nn.Module) -> None:
        """Write the averaged weights (and buffers) into ``module``, a model of the same shape.

        ``module`` may be wrapped in DDP or ``torch.compile``; names are matched on the
        unwrapped module.
        """
        shadow = self._require_shadow()
        entries = _entries(unwrap(module))
        missing = [name for name in entries if name not in shadow]
        if missing:
            raise ConfigurationError(
                f"copy_to: the module has entries the EMA does not know: {missing[:5]}. Pass a "
                "module with the architecture of the trained model.")
        for name, tensor in entries.items():
            tensor.copy_(shadow[name])

    @contextmanager
    def swapped(self, module: nn.Module | None = None) -> Iterator[nn.Module]:
        """Use the averaged weights inside the ``with`` block, then restore the module's own.

        Restores on exceptions too. ``module`` defaults to the model of the last fit.

        Example:
            >>> with ema.swapped(model):  # doctest: +SKIP
            ...     evaluate(model)
        """
        target = unwrap(module) if module is not None else self._model
        if target is None:
            raise RuntimeError("EMA.swapped() needs a module before the first fit: swapped(model).")
        with torch.no_grad():
            backup = {name: tensor.detach().clone() for name, tensor in _entries(target).items()}
        try:
            self.copy_to(target)
            regather(target)  # FSDP gathered the training weights for this pass: again
            yield target
        finally:
            with torch.no_grad():
                for name, tensor in _entries(target).items():
                    tensor.copy_(backup[name])

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights as a model state dict (float32 copies), for saving or loading.

        ``model.load_state_dict(ema.averaged_state_dict())`` casts back to the model's dtypes.
        """
        shadow = self._require_shadow()
        clones: dict[int, torch.Tensor] = {}
        return {name: clones.setdefault(id(tensor), tensor.detach().clone())
                for name, tensor in shadow.items()}

    def averaged_model(self, module: nn.Module | None = None) -> nn.Module:
        """A deep copy of ``module`` (default: the trained model) holding the EMA weights, in eval mode."""
        source = unwrap(module) if module is not None else self._model
        if source is None:
            raise RuntimeError("EMA.averaged_model() needs a module before the first fit: "
                               "averaged_model(model).")
        averaged = copy.deepcopy(source)
        self.copy_to(averaged)
        return averaged.eval()

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The shadow (unwrapped names -> tensors), the update count ``t`` and the decay."""
        return {
            "shadow": {} if self._shadow is None else self.averaged_state_dict(),
            "updates": self.updates,
            "decay": self.decay,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a shadow; it is placed on the model's device at fit start (the loop
        loads it before ``on_fit_start``), or at once when a model is known already."""
        shadow = dict(state.get("shadow") or {})
        self.updates = int(state.get("updates", 0))
        if not shadow:
            return
        self._shadow = shadow
        if self._model is not None:
            self._build(self._model)
