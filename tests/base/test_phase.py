"""loop.phase: what each event sees, and the callbacks that decide on validations use it.

Oracles: the phase sequence written out by hand for a fit with a sanity check, a step
validation and a ``validate()`` a callback calls inside ``fit``; EarlyStopping's counters
and ReduceLROnPlateau's step count recomputed from the run's history; TensorBoard's event
files read back with tensorboard's EventAccumulator. An ``ast`` scan checks that no callback
module combines the flags that ``loop.phase`` replaces.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.optim.lr_scheduler import ReduceLROnPlateau

from hookloop import Callback, Loop, Phase
from hookloop.callbacks import EarlyStopping, LRScheduler, TensorBoard

CALLBACKS = Path(__file__).resolve().parents[2] / "hookloop" / "callbacks"
BATCHES = 4


def make_loop(callbacks: list[Callback], *, val: bool = True, **options: object) -> Loop:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(BATCHES)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), data,
                val_data=data[:2] if val else None, loss_fn=F.mse_loss, device="cpu",
                callbacks=callbacks, **options)  # type: ignore[arg-type]


class Phases(Callback):
    """Records ``(event, loop.phase)``; it produces a metric, so it sees the sanity check."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Phase]] = []

    def produces(self, loop: Loop) -> list[str]:
        return ["val_seen"]

    def on_fit_start(self, loop: Loop) -> None:
        self.seen.append(("on_fit_start", loop.phase))

    def on_batch_start(self, loop: Loop) -> None:
        if loop.state.batch_idx == 0:
            self.seen.append(("on_batch_start", loop.phase))

    def on_validation_start(self, loop: Loop) -> None:
        self.seen.append(("on_validation_start", loop.phase))

    def on_validation_end(self, loop: Loop) -> None:
        loop.state.metrics["val_seen"] = 1.0
        self.seen.append(("on_validation_end", loop.phase))

    def on_epoch_end(self, loop: Loop) -> None:
        self.seen.append(("on_epoch_end", loop.phase))

    def on_fit_end(self, loop: Loop) -> None:
        self.seen.append(("on_fit_end", loop.phase))


class ValidatesItself(Callback):
    """Calls ``loop.validate()`` at every epoch end: a pass inside fit that does not count."""

    def on_epoch_end(self, loop: Loop) -> None:
        loop.validate()


def test_the_phase_each_event_sees() -> None:
    phases = Phases()
    loop = make_loop([phases, ValidatesItself()], sanity_val_batches=1, val_every_n_steps=2)
    assert loop.phase is Phase.IDLE
    loop.fit(1)
    validate = [("on_validation_start", Phase.VALIDATE), ("on_validation_end", Phase.VALIDATE)]
    evaluate = [("on_validation_start", Phase.EVALUATE), ("on_validation_end", Phase.EVALUATE)]
    assert phases.seen == [
        ("on_fit_start", Phase.TRAIN),
        ("on_validation_start", Phase.SANITY_CHECK), ("on_validation_end", Phase.SANITY_CHECK),
        ("on_batch_start", Phase.TRAIN),
        *validate,  # after step 2
        *validate,  # after step 4, the epoch's last: no second one at its end
        ("on_epoch_end", Phase.TRAIN),
        *evaluate,  # ValidatesItself
        ("on_fit_end", Phase.TRAIN),
    ]
    assert loop.phase is Phase.IDLE
    loop.validate()
    assert phases.seen[-2:] == evaluate and loop.phase is Phase.IDLE


def hand_early_stopping(values: list[float]) -> tuple[float, int]:
    """``(best, wait)`` of a patience counter fed ``values`` (mode min, min_delta 0)."""
    best, wait = float("inf"), 0
    for value in values:
        if value < best:
            best, wait = value, 0
        else:
            wait += 1
    return best, wait


def test_early_stopping_counts_only_the_validations_of_fit() -> None:
    stopper = EarlyStopping(patience=100)
    loop = make_loop([ValidatesItself(), stopper], sanity_val_batches=2)
    loop.fit(4)
    values = [row["val_loss"] for row in loop.state.history]
    assert len(values) == 4  # one validation per epoch; the validate() passes are not rows
    assert (stopper.best, stopper.wait) == hand_early_stopping(values)
    assert stopper.wait == 0  # counting the validate() after each epoch end would give 1


def test_early_stopping_without_validation_data_decides_at_complete_epoch_ends() -> None:
    class TrainLosses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_epoch_end(self, loop: Loop) -> None:
            if loop.epoch_completed:
                self.values.append(loop.state.metrics["train_loss"])

    losses, stopper = TrainLosses(), EarlyStopping(monitor="train_loss", patience=100)
    loop = make_loop([losses, stopper], val=False)
    loop.fit(3)
    assert len(losses.values) == 3
    assert (stopper.best, stopper.wait) == hand_early_stopping(losses.values)
    assert stopper.best_epoch == losses.values.index(min(losses.values))


def test_a_plateau_schedule_steps_once_per_validation_of_fit() -> None:
    loop = make_loop([])
    plateau = ReduceLROnPlateau(loop.optimizer, patience=100)
    loop.callbacks.append(LRScheduler(plateau, monitor="val_loss"))
    loop.callbacks.insert(0, ValidatesItself())
    loop.sanity_val_batches = 2
    loop.fit(3)
    assert len(loop.state.history) == 3
    assert plateau.last_epoch == 3  # not 6 (validate() inside fit) nor 7 (the sanity check)
    assert plateau.best == min(row["val_loss"] for row in loop.state.history)


def test_tensorboard_logs_the_metrics_of_the_validations_of_fit(tmp_path: Path) -> None:
    loop = make_loop([ValidatesItself(), TensorBoard(tmp_path, every_n_steps=100)],
                     sanity_val_batches=2)
    loop.fit(3)
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    logged = [(event.step, event.value) for event in accumulator.Scalars("metrics/val_loss")]
    expected = [(row["step"], row["val_loss"]) for row in loop.state.history]
    assert [step for step, _ in logged] == [step for step, _ in expected] == [4, 8, 12]
    assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(logged, expected))


def _reads(tree: ast.AST, attribute: str) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == attribute]


def _compares_prefix(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(isinstance(part, ast.Attribute) and part.attr == "prefix"
                    for part in (node.left, *node.comparators))]


def test_no_callback_combines_the_flags_that_phase_replaces() -> None:
    combined = {}
    for path in sorted(CALLBACKS.glob("*.py")):
        if path.name == "checkpoint.py":  # Checkpoint is moved to loop.phase with its split
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = _reads(tree, "sanity_checking") + _compares_prefix(tree)
        if lines:
            combined[path.name] = lines
    assert combined == {}, f"ask loop.phase (or Monitor.due) instead, at lines {combined}"
