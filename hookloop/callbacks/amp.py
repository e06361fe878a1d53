"""Mixed precision: autocast around forward and loss, a GradScaler for float16."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from hookloop.base.checks import check_flag, check_int, check_name, check_number
from hookloop.base.compat import generic_grad_scaler_step
from hookloop.callback import Callback
from hookloop.errors import ConfigurationError
from hookloop.runfile.sharded import grad_scaler

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["AMP"]

_DTYPES: dict[Any, torch.dtype] = {
    torch.float16: torch.float16, "float16": torch.float16, "fp16": torch.float16,
    "half": torch.float16, "16": torch.float16,
    torch.bfloat16: torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


#: Consecutive skipped steps after which AMP warns (once): the scale has been halved this
#: many times, far below where a real float16 overflow would have stopped.
SKIPPED_IN_A_ROW_WARNING = 25
#: The scale never goes below this: at 0 every gradient becomes 0 * inf = NaN.
MIN_SCALE = 2.0 ** -16


# The GradScaler arguments AMP accepts in ``scaler={...}``.
_SCALER_ARGUMENTS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def _checked_scaler_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` checked as GradScaler would (it uses ``assert``, or nothing)."""
    unknown = sorted(set(arguments) - set(_SCALER_ARGUMENTS), key=repr)
    if unknown:
        raise ConfigurationError(
            f"AMP scaler must be a dict of torch.amp.GradScaler arguments "
            f"({', '.join(_SCALER_ARGUMENTS)}), got the unknown key(s) {unknown}.")
    for key, value in arguments.items():
        label = f"AMP scaler {key}"
        if key == "init_scale":
            check_number(label, value, above=0, hint="A usual start is 65536.0.")
        elif key == "growth_factor":
            check_number(label, value, above=1, hint="The usual factor is 2.0.")
        elif key == "backoff_factor":
            check_number(label, value, above=0, below=1, hint="The usual factor is 0.5.")
        elif key == "growth_interval":
            check_int(label, value, hint="The usual interval is 2000 steps.")
        else:
            check_flag(label, value)
    return dict(arguments)


#: AMP's methods that only act with a GradScaler (`AMP._silent_events`).
_SCALER_EVENTS = ("scale_loss", "before_step", "on_batch_end", "optimizer_step")

class AMP(Callback):
    """Automatic mixed precision with ``torch.autocast`` and ``torch.amp.GradScaler``.

    Forward and loss run under ``torch.autocast(loop.device.type, dtype)``, in training and
    in validation; backward never does. With a scaler (the default for float16) the loss is
    scaled for backward, the gradients are unscaled in ``before_step`` (so callbacks after
    AMP, such as `GradClip`, see true gradients), and the step goes through
    ``scaler.step`` and ``scaler.update``. A step whose gradients hold inf/NaN is skipped by
    the scaler: ``after_step`` does not fire, ``loop.state.step`` does not advance, and the
    scale is multiplied by ``backoff_factor`` (halved by default).

    If a callback cancels the step (``loop.cancel_step()``) after AMP unscaled the
    gradients, AMP still calls ``scaler.update()`` (at ``on_batch_end``), so the next
    ``unscale_`` does not fail with "unscale_() has already been called". Likewise, if
    ``optimizer.step`` raises (Ctrl-C during the step), the owed ``scaler.update()`` is
    made at ``on_fit_end``, so a later ``fit`` of the same loop works.

    Fused or capturable optimizers (``Adam(fused=True)``...) normally receive the inf flag
    from GradScaler and skip the update inside their kernel, but their ``step`` is still
    called, which the loop would count as a real step. AMP makes GradScaler treat them like
    any optimizer for the duration of ``scaler.step`` (the gradients are already unscaled
    in ``before_step``), so a skipped step really skips ``optimizer.step``.

    Many skipped steps in a row (`SKIPPED_IN_A_ROW_WARNING`, 25) are not an overflow the
    scaler can fix: AMP warns once, with the count and the likely causes. The scale is kept
    at or above `MIN_SCALE` (``2**-16``) so that it never reaches 0, where every gradient
    would become NaN and the next clean batch would be stepped with them.

    The scaler is created at the first ``setup`` and continues across ``fit`` calls on the
    same loop; a resumed run's scale is loaded into it before ``on_fit_start``.

    AMP takes the optimizer step (it overrides ``optimizer_step``), so no other callback in
    the stack may route it. Its state (the scaler's scale and growth tracker, and the count
    of skipped steps) is checkpointed.

    Args:
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``; the strings ``"bf16"``
            and ``"fp16"`` work too.
        scaler: None: a GradScaler for float16 only. True/False: force it on/off. A dict:
            on, with these ``torch.amp.GradScaler`` arguments (``init_scale``,
            ``growth_factor``, ``backoff_factor``, ``growth_interval``).
        name: State key, to tell two stacks' AMP states apart in one checkpoint.

    Raises:
        ConfigurationError: an unsupported dtype, a scaler value GradScaler would reject
            (``growth_factor <= 1``, ``backoff_factor`` outside (0, 1), ``init_scale <= 0``,
            ``growth_interval < 1``), a bad ``name``; at setup, float16 or
            bfloat16 trainable parameters together with a scaler.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> from hookloop.callbacks import AMP, GradClip
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[AMP(torch.float16, scaler={"init_scale": 1024.0}),
        ...                        GradClip(1.0)])
        >>> loop.fit(1).step
        hookloop: training ended at epoch 1/1, step 3: its 1 epoch is done.
        3
    """

    state_at_boundaries = True  # its scaler changes at steps only

    unique = True
    runs_after = {"FSDP": "AMP gives a model FSDP shards its sharded GradScaler (a step with an "
                          "inf/NaN in any rank's shards is skipped on every rank), so FSDP must "
                          "have sharded the model when AMP sets up"}

    def __init__(self, dtype: torch.dtype | str = torch.bfloat16,
                 scaler: bool | Mapping[str, Any] | None = None, *, name: str | None = None) -> None:
        key = dtype.lower() if isinstance(dtype, str) else dtype
        if not isinstance(key, (str, torch.dtype)) or key not in _DTYPES:
            raise ConfigurationError(
                f"AMP dtype must be torch.bfloat16 or torch.float16 ('bf16'/'fp16'), got "
                f"{dtype!r}. For full precision, leave AMP out of the callbacks.")
        self.dtype = _DTYPES[key]
        if scaler is None:
            scaler = self.dtype == torch.float16
        if isinstance(scaler, Mapping):
            self._scaler_kwargs: dict[str, Any] | None = _checked_scaler_arguments(scaler)
        elif isinstance(scaler, bool):
            self._scaler_kwargs = {} if scaler else None
        else:
            raise ConfigurationError(
                f"AMP scaler must be None, True, False or a dict of GradScaler arguments, got "
                f"{scaler!r}.")
        self.name = check_name("AMP name", name)
        self._scaler: torch.amp.GradScaler | None = None
        self._skipped_in_row = 0
        self._warned_skips = False
        self._scaler_device: str | None = None
        self._unscaled = False  # unscale_ ran at this boundary and update() is still owed
        # ``loop.device`` and its type, read once per device: ``device.type`` costs as much
        # as a tenth of a tiny step's loop overhead, at every batch.
        self._device: torch.device | None = None
        self._device_type = "cpu"
        #: Steps the scaler skipped because of inf/NaN gradients, over the whole run.
        self.skipped_steps = 0

    def __repr__(self) -> str:
        dtype = "float16" if self.dtype == torch.float16 else "bfloat16"
        scaler = self._scaler_kwargs is not None
        return f"AMP(dtype=torch.{dtype}, scaler={scaler}" + (
            f", name={self.name!r})" if self.name else ")")

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (created at setup), or None without scaling."""
        return self._scaler

    # -------------------------------------------------------------------- setup
    def setup(self, loop: Loop) -> None:
        """Create the scaler for ``loop.device`` and publish it as ``loop.scaler``.

        ``loop.scaler`` is None without a scaler (bfloat16) or with a disabled one: other
        callbacks (`TerminateOnNaN`, `TensorBoard`) read it there. Half-precision trainable
        weights together with a scaler are refused.
        """
        loop.scaler = None
        if self._scaler_kwargs is None:
            return
        bad = [(group_index, param.dtype) for group_index, group in enumerate(loop.optimizer.param_groups)
               for param in group["params"]
               if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16)]
        if bad:
            raise ConfigurationError(
                f"AMP with a GradScaler needs float32 trainable parameters, but the optimizer "
                f"holds {len(bad)} {bad[0][1]} parameter(s) (param group {bad[0][0]}); "
                "GradScaler cannot unscale half-precision gradients ('Attempting to unscale "
                "FP16 gradients'). Keep the weights in float32 (model.float(), then create the "
                "optimizer) and let autocast compute in half precision, or use "
                "AMP(torch.bfloat16) without a scaler.")
        device_type = loop.device.type
        wanted = grad_scaler(loop.unwrapped_model, device_type, **self._scaler_kwargs)
        if self._scaler is None or self._scaler_device != device_type or \
                type(self._scaler) is not type(wanted):
            previous = self._scaler.state_dict() if self._scaler is not None else None
            self._scaler = wanted
            self._scaler_device = device_type
            if previous:
                self._scaler.load_state_dict(previous)
        # A disabled GradScaler neither scales nor skips a step: nothing for others to read.
        loop.scaler = self._scaler if self._scaler.is_enabled() else None

    def on_fit_start(self, loop: Loop) -> None:
        self._unscaled = False

    @property
    def _silent_events(self) -> tuple[str, ...]:
        """Without a scaler (bfloat16) its loss, step and batch-end methods do nothing but
        call ``optimizer.step()``: not called (the loop steps the optimizer itself), so a
        batch pays no call of them. Read when the fit's table is built, after ``setup``."""
        if self._scaler is not None:
            return ()
        return tuple(name for name in _SCALER_EVENTS  # a subclass's own method is called
                     if getattr(type(self), name) is getattr(AMP, name))

    def on_fit_end(self, loop: Loop) -> None:
        self._finish_cancelled_step()

    # -------------------------------------------------------------------- batch
    def forward_context(self, loop: Loop) -> AbstractContextManager[Any]:
        """``torch.autocast`` for the loop's device type and this callback's dtype."""
        device = loop.device
        if device is not self._device:
            self._device, self._device_type = device, device.type
        return torch.autocast(self._device_type, dtype=self.dtype)

    def scale_loss(self, loop: Loop, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale (unchanged without a scaler)."""
        scaler = self._scaler
        return loss if scaler is None else scaler.scale(loss)

    def before_step(self, loop: Loop) -> None:
        """Unscale the gradients in place, so later callbacks see their true values."""
        if self._scaler is not None:
            self._scaler.unscale_(loop.optimizer)
            self._unscaled = True

    def optimizer_step(self, loop: Loop) -> None:
        """``scaler.step`` then ``scaler.update`` (a plain ``optimizer.step`` without a scaler)."""
        scaler, optimizer = self._scaler, loop.optimizer
        if scaler is None:
            optimizer.step()
            return
        # Fused/capturable optimizers would be stepped even for an inf step (their kernel
        # skips it on the device), and the loop would count that step. The gradients are
        # unscaled already, so GradScaler's generic path is taken instead.
        with generic_grad_scaler_step(optimizer):
            scaler.step(optimizer)
        scaler.update()
        # Only now is the unscale_ paired: if step raised (Ctrl-C), on_fit_end updates.
        self._unscaled = False
        if loop.optimizer_stepped:
            self._skipped_in_row = 0
            return
        # The loop's step hook saw no optimizer.step: the scaler skipped it (inf/NaN).
        self.skipped_steps += 1
        self._skipped_in_row += 1
        # Reading the scale syncs, but only after a skipped step, whose scaler.step synced
        # on the inf flag already.
        scale = scaler.get_scale()
        if scale < MIN_SCALE:
            scaler.update(new_scale=MIN_SCALE)
        if self._skipped_in_row >= SKIPPED_IN_A_ROW_WARNING and not self._warned_skips:
            self._warned_skips = True
            warnings.warn(
                f"AMP: the GradScaler skipped the last {self._skipped_in_row} optimizer steps "
                f"in a row (step {loop.state.step}, {self.skipped_steps} skipped in all) "
                f"because the gradients held inf/NaN, and the loss scale is down to "
                f"{max(scale, MIN_SCALE):.3g}. A float16 overflow stops after a few halvings; "
                "this many means the forward pass or the loss itself produces inf/NaN (bad "
                "inputs or labels, a log or division of 0, a learning rate that diverged) or "
                "an activation exceeds float16's range (65504) even unscaled. The weights are "
                "those of the last good step. Check the data and the loss, try "
                "AMP(torch.bfloat16), or add TerminateOnNaN() to stop at the first non-finite "
                f"loss. (Warned once; the scale is kept >= {MIN_SCALE:g} so it never reaches 0.)",
                RuntimeWarning, stacklevel=2)

    def on_batch_end(self, loop: Loop) -> None:
        self._finish_cancelled_step()

    def _finish_cancelled_step(self) -> None:
        # A callback cancelled the step after unscale_: update() must still pair with it,
        # or the next unscale_ raises "unscale_() has already been called".
        if self._unscaled and self._scaler is not None:
            self._scaler.update()
            self._unscaled = False
            if self._scaler.get_scale() < MIN_SCALE:
                self._scaler.update(new_scale=MIN_SCALE)

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, growth tracker...) and the skipped-step count."""
        scaler_state = self._scaler.state_dict() if self._scaler is not None else {}
        return {"scaler": scaler_state, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler and the counters (the loop calls it after ``setup``).

        A saved scale is ignored when this AMP runs without a scaler (bfloat16).
        """
        self.skipped_steps = int(state.get("skipped_steps", 0))
        scaler_state = state.get("scaler") or None
        if scaler_state is not None and self._scaler is not None:
            self._scaler.load_state_dict(scaler_state)
