"""`Timer`: the time spent training, validating and in all, as metrics."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hookloop.base.phase import Phase
from hookloop.callback import Callback

if TYPE_CHECKING:
    from hookloop.loop import Loop

__all__ = ["Timer", "TIME_METRICS"]

#: The metrics `Timer` writes (Composer's names): seconds of the run so far.
TIME_METRICS = ("time/train", "time/val", "time/total")


class Timer(Callback):
    """Time as data: ``time/train``, ``time/val`` and ``time/total`` in ``loop.state.metrics``.

    Seconds of wall time since the run started, summed over its fits and launches (the
    totals are saved with the run, so a resumed run goes on counting):

    * ``time/val``: inside validation passes: every validation of ``fit``, and a
      ``validate()``/``evaluate()`` a callback runs inside it (not the sanity check);
    * ``time/total``: inside ``fit``, from ``on_fit_start`` on (the short sanity check
      before training is in none of the three);
    * ``time/train``: the rest, ``time/total - time/val``: training batches, steps,
      callbacks, saves.

    They are written at the end of every validation that counts (so each row of
    ``loop.state.history`` has them) and at every epoch end, where the views read them
    (`TensorBoard` as ``metrics/time/train``..., `CSVLogger`, ``fit``'s returned metrics).
    Put it before the views. Each rank reads its own clock, a few times an epoch, never
    per batch; the time after the last save of a killed launch is not in the resumed totals.

    Example:
        >>> import torch
        >>> from hookloop import Loop
        >>> model = torch.nn.Linear(4, 1)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
        >>> loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        ...             val_data=data[:1], loss_fn=torch.nn.functional.mse_loss,
        ...             device="cpu", callbacks=[Timer()])
        >>> metrics = loop.fit(1).metrics
        hookloop: training ended at epoch 1/1, step 4: its 1 epoch is done.
        >>> metrics["time/total"] >= metrics["time/train"] >= 0.0 and metrics["time/val"] > 0
        True
    """

    def __init__(self) -> None:
        self._total = 0.0  # seconds of fits that ended (and of the run restored)
        self._val = 0.0  # seconds of validation passes that ended
        self._fit_started: float | None = None
        self._val_started: float | None = None
        self._val_phase: Phase | None = None  # of the pass being timed (not one inside it)

    def __repr__(self) -> str:
        return "Timer()"

    def produces(self, loop: Loop) -> Iterable[str]:
        return TIME_METRICS

    def seconds(self) -> dict[str, float]:
        """The three totals now, as in the metrics (also between two writes)."""
        now = time.monotonic()
        total = self._total + (now - self._fit_started if self._fit_started is not None else 0.0)
        val = self._val + (now - self._val_started if self._val_started is not None else 0.0)
        return {"time/train": max(total - val, 0.0), "time/val": val, "time/total": total}

    # ------------------------------------------------------------------ events
    def on_fit_start(self, loop: Loop) -> None:
        self._fit_started, self._val_started = time.monotonic(), None

    def on_validation_start(self, loop: Loop) -> None:
        if self._fit_started is not None and loop.phase is not Phase.SANITY_CHECK and \
                self._val_started is None:  # a pass inside it (EMA's second) is its time
            self._val_started, self._val_phase = time.monotonic(), loop.phase

    def on_validation_end(self, loop: Loop) -> None:
        if self._val_started is None or loop.phase is not self._val_phase:
            return
        self._val += time.monotonic() - self._val_started
        self._val_started = None
        if loop.phase is Phase.VALIDATE:  # the history's row is taken after this event
            loop.state.metrics.update(self.seconds())

    def on_epoch_end(self, loop: Loop) -> None:
        loop.state.metrics.update(self.seconds())

    def on_fit_end(self, loop: Loop) -> None:
        if self._fit_started is not None:
            self._total += time.monotonic() - self._fit_started
        self._fit_started = self._val_started = None

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The totals now: ``{"total": seconds, "val": seconds}``."""
        seconds = self.seconds()
        return {"total": seconds["time/total"], "val": seconds["time/val"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on counting from `state_dict`'s totals (a fit running counts on from now)."""
        self._total, self._val = float(state["total"]), float(state["val"])
        if self._fit_started is not None:
            self._fit_started = time.monotonic()
        self._val_started = None
