"""A callback of your own, with state that survives a resume.

    python examples/custom_callback.py                   # 2 epochs, "crash", resume to 4
    python examples/custom_callback.py --epochs 6 --stop-after 3

`LossHistory` counts the samples trained on and keeps every epoch's training loss. It
stores both through ``state_dict``/``load_state_dict``, so `Checkpoint` saves them with
the model and a resumed run carries on counting where the first one stopped. The script
trains, stops as if the process died, resumes in a new loop, and compares the result with
an uninterrupted run: the same history, the same sample count, the same weights.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Callback, Loop
from hookloop.callbacks import Checkpoint, GradClip


class LossHistory(Callback):
    """Count the training samples and keep the training loss of every complete epoch.

    Example:
        >>> history = LossHistory()
        >>> history.load_state_dict({"samples": 64, "losses": [0.5]})
        >>> history.samples, history.losses
        (64, [0.5])
    """

    def __init__(self) -> None:
        self.samples = 0
        self.losses: list[float] = []

    def on_batch_end(self, loop: Loop) -> None:
        self.samples += loop.state.batch_size      # a Python int: no device sync per batch

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.epoch_completed:                   # an epoch cut short has no full train_loss
            self.losses.append(loop.state.metrics["train_loss"])
            print(f"epoch {loop.state.epoch + 1}: train_loss {self.losses[-1]:.4f}, "
                  f"{self.samples} samples so far", flush=True)

    # Plain numbers and lists: checkpoints load with torch.load(weights_only=True).
    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state["samples"])
        self.losses = [float(loss) for loss in state["losses"]]


def make_loop(checkpoint_dir: str | None, resume: bool) -> tuple[Loop, LossHistory]:
    """The same model, data and stack every time, from the same seed."""
    torch.manual_seed(0)
    inputs = torch.randn(256, 8)
    targets = inputs @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
    data = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True,
                      generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    history = LossHistory()
    callbacks: list[Callback] = [GradClip(1.0), history]
    if checkpoint_dir is not None:
        callbacks.append(Checkpoint(checkpoint_dir, resume=resume))   # after the stateful ones
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data, loss_fn=F.mse_loss,
                callbacks=callbacks, device="cpu")
    return loop, history


def main(argv: list[str] | None = None) -> LossHistory:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the whole run")
    parser.add_argument("--stop-after", type=int, default=2, help="epochs before the 'crash'")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as checkpoint_dir:
        print(f"-- first process: {args.stop_after} epochs, then it dies")
        loop, _ = make_loop(checkpoint_dir, resume=False)
        loop.fit(args.stop_after)
        print(f"-- second process: resume and train to {args.epochs} epochs")
        loop, resumed = make_loop(checkpoint_dir, resume=True)
        loop.fit(args.epochs)
        resumed_weights = [parameter.detach().clone() for parameter in loop.model.parameters()]

    print("-- for comparison: one uninterrupted run")
    loop, uninterrupted = make_loop(None, resume=False)
    loop.fit(args.epochs)
    same_weights = all(torch.equal(a, b) for a, b in zip(resumed_weights, loop.model.parameters()))
    same = (resumed.losses == uninterrupted.losses and resumed.samples == uninterrupted.samples
            and same_weights)
    print(f"resumed run: {len(resumed.losses)} epochs, {resumed.samples} samples; "
          f"identical to the uninterrupted run: {same}")
    if not same:
        raise SystemExit("the resumed run differs from the uninterrupted one")
    return resumed


if __name__ == "__main__":
    main()
