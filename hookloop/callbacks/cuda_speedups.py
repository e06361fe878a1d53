"""The two CUDA switches most training scripts set by hand: cuDNN autotuning and TF32."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from hookloop.base.checks import check_flag
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["CudaSpeedups"]


def _switches() -> dict[str, Any]:
    return {"cudnn_benchmark": torch.backends.cudnn.benchmark,
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32}


def _set(switches: dict[str, Any]) -> None:
    torch.backends.cudnn.benchmark = switches["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = switches["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = switches["cudnn_tf32"]


class CudaSpeedups(Callback):
    """Turn on cuDNN's autotuner and TF32 matrix products for the fit, on CUDA.

    * ``cudnn_benchmark``: ``torch.backends.cudnn.benchmark = True``: cuDNN times its
      convolution algorithms on the first batch of each input shape and keeps the
      fastest. Worth it for fixed shapes (images of one size); with shapes that change
      every batch it tunes again and again, so leave it off there.
    * ``tf32``: ``torch.backends.cuda.matmul.allow_tf32`` and
      ``torch.backends.cudnn.allow_tf32``: float32 matrix products and convolutions on
      Ampere and later GPUs use TF32 (10-bit mantissa inputs, float32 accumulation),
      several times faster; results differ from full float32 in about the fourth digit.
      Under ``AMP`` the half-precision products are unaffected.

    The switches are process-wide: they are set at fit start and put back as they were
    at fit end (also after an exception), so a later run in the same process starts from
    the same settings; a ``validate()`` or ``predict()`` outside fit runs without them. On a device other than CUDA there is nothing to switch: the callback
    does nothing and says so once (a ``UserWarning``), so one script runs anywhere.

    Args:
        cudnn_benchmark: Turn on cuDNN's autotuner.
        tf32: Allow TF32 for float32 matrix products and convolutions.

    Raises:
        ConfigurationError: a setting that is not a bool.

    Example:
        >>> import warnings, torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1))]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             loss_fn=torch.nn.functional.mse_loss, device="cpu",
        ...             callbacks=[CudaSpeedups()])
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     _ = loop.fit(1)
        hookloop: training ended at epoch 1/1, step 1: its 1 epoch is done.
        >>> "nothing to switch" in str(said[0].message)
        True
    """

    unique = True

    def __init__(self, *, cudnn_benchmark: bool = True, tf32: bool = True) -> None:
        self.cudnn_benchmark = check_flag("CudaSpeedups cudnn_benchmark", cudnn_benchmark)
        self.tf32 = check_flag("CudaSpeedups tf32", tf32)
        self._saved: dict[str, Any] | None = None
        self._noted = False

    def __repr__(self) -> str:
        return f"CudaSpeedups(cudnn_benchmark={self.cudnn_benchmark}, tf32={self.tf32})"

    def on_fit_start(self, loop: Loop) -> None:
        """Set the switches on CUDA; elsewhere say once that there is nothing to set."""
        if loop.device.type != "cuda":
            if not self._noted:
                self._noted = True
                warnings.warn(
                    f"CudaSpeedups: the loop runs on {loop.device.type}, so there is nothing to "
                    "switch (cuDNN autotuning and TF32 are CUDA settings); it does nothing.",
                    stacklevel=5)  # the user's fit() call
            return
        if self._saved is None:
            self._saved = _switches()
        wanted = dict(self._saved)
        if self.cudnn_benchmark:
            wanted["cudnn_benchmark"] = True
        if self.tf32:
            wanted["matmul_tf32"] = wanted["cudnn_tf32"] = True
        _set(wanted)

    def on_fit_end(self, loop: Loop) -> None:
        """Put the switches back as they were before this fit."""
        self._restore()

    def _restore(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            _set(saved)
