"""The event sequence is the ground truth of the loop: recorded and compared exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, Event, Loop
from hookloop.base.events import HOOKS

from builders import EventRecorder
from builders import classification_batches, make_loop


def _loop(recorder: EventRecorder, train_batches: int = 2, val_batches: int = 2) -> Loop:
    # No seed of its own: the autouse fixture's, as every test here starts with.
    return make_loop([recorder], model=lambda: torch.nn.Linear(3, 2),
                     train=lambda: classification_batches(train_batches, features=3, classes=2),
                     val=lambda train: classification_batches(val_batches, features=3, classes=2),
                     loss_fn=F.cross_entropy, seed=None)


def _train_batch(epoch: int, batch: int, step_after: int) -> list[tuple]:
    before = step_after - 1
    return [
        ("on_batch_start", epoch, batch, before),
        ("after_forward", epoch, batch, before),
        ("after_backward", epoch, batch, before),
        ("before_step", epoch, batch, before),
        ("after_step", epoch, batch, step_after),
        ("on_batch_end", epoch, batch, step_after),
    ]


def _validation(epoch: int, step: int) -> list[tuple]:
    return [
        ("on_validation_start", epoch, 1, step),
        ("on_validation_batch_start", epoch, 0, step),
        ("on_validation_batch_end", epoch, 0, step),
        ("on_validation_batch_start", epoch, 1, step),
        ("on_validation_batch_end", epoch, 1, step),
        ("on_validation_end", epoch, 1, step),
    ]


def test_two_epoch_fit_emits_every_event_in_order() -> None:
    recorder = EventRecorder()
    _loop(recorder).fit(2)
    expected = [("on_fit_start", 0, 0, 0)]
    step = 0
    for epoch in range(2):
        expected.append(("on_epoch_start", epoch, 1 if epoch else 0, step))
        for batch in range(2):
            step += 1
            expected += _train_batch(epoch, batch, step)
        expected += _validation(epoch, step)
        expected.append(("on_epoch_end", epoch, 1, step))
    expected.append(("on_fit_end", 1, 1, 4))
    assert recorder.events == expected


def test_exception_mid_batch_fires_on_exception_then_on_fit_end_and_propagates() -> None:
    recorder = EventRecorder(fail_at=("after_backward", 1, 0))
    with pytest.raises(RuntimeError, match="boom") as info:
        _loop(recorder).fit(3)
    tail = recorder.events[-6:]
    assert tail == [
        ("on_epoch_start", 1, 1, 2),
        ("on_batch_start", 1, 0, 2),
        ("after_forward", 1, 0, 2),
        ("after_backward", 1, 0, 2),
        ("on_exception", "RuntimeError"),
        ("on_fit_end", 1, 0, 2),
    ]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "Recorder" in notes and "after_backward" in notes


def test_keyboard_interrupt_is_handled_like_an_exception() -> None:
    recorder = EventRecorder(fail_at=("on_batch_end", 0, 1), exc=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        _loop(recorder).fit(2)
    assert recorder.events[-2:] == [("on_exception", "KeyboardInterrupt"), ("on_fit_end", 0, 1, 2)]


def test_stop_ends_at_the_next_batch_boundary_and_still_fires_epoch_and_fit_end() -> None:
    class StopAfterFirstBatch(Callback):
        def on_batch_end(self, loop):
            loop.stop("enough")

    recorder = EventRecorder()
    loop = _loop(recorder, train_batches=5)
    loop.callbacks.insert(0, StopAfterFirstBatch())
    state = loop.fit(3)
    names = [event[0] for event in recorder.events]
    assert names.count("on_batch_start") == 1
    assert "on_validation_start" not in names  # an epoch cut short is not validated
    assert names[-2:] == ["on_epoch_end", "on_fit_end"]
    assert state.step == 1 and loop.stop_reason == "enough"


def test_validate_alone_runs_the_validation_events() -> None:
    recorder = EventRecorder()
    loop = _loop(recorder)
    metrics = loop.validate()
    assert [event[0] for event in recorder.events] == [
        "on_validation_start", "on_validation_batch_start", "on_validation_batch_end",
        "on_validation_batch_start", "on_validation_batch_end", "on_validation_end"]
    assert set(metrics) == {"val_loss"}


def test_event_enum_matches_callback_methods_one_to_one() -> None:
    methods = {name for name in vars(Callback) if name.startswith(("on_", "before_", "after_"))}
    assert methods == {event.value for event in Event}
    for hook in HOOKS:
        assert callable(getattr(Callback, hook))


def test_events_nobody_listens_to_are_not_in_the_dispatch_table() -> None:
    class OnlyAfterStep(Callback):
        def after_step(self, loop):
            pass

    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,)))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, callbacks=[OnlyAfterStep()], device="cpu")
    loop.fit(1)
    table = loop._table
    assert len(table.after_step) == 1
    for event in Event:
        if event is not Event.AFTER_STEP:
            assert getattr(table, event.value) == ()


def test_cancelled_step_fires_no_after_step_and_does_not_count() -> None:
    class CancelAll(Callback):
        def before_step(self, loop):
            loop.cancel_step()

    recorder = EventRecorder()
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, callbacks=[CancelAll(), recorder], device="cpu")
    state = loop.fit(1)
    assert state.step == 0
    assert "after_step" not in [event[0] for event in recorder.events]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # dropped, not carried over


def test_max_steps_stops_training() -> None:
    recorder = EventRecorder()
    state = _loop(recorder, train_batches=4).fit(5, max_steps=6)
    assert state.step == 6
    assert [event[0] for event in recorder.events].count("on_epoch_start") == 2


def test_fit_counts_epochs_in_total_so_a_second_fit_continues() -> None:
    recorder = EventRecorder()
    loop = _loop(recorder)
    loop.fit(1)
    loop.fit(3)
    starts = [event[1] for event in recorder.events if event[0] == "on_epoch_start"]
    assert starts == [0, 1, 2]
    assert loop.state.step == 6


def test_an_error_in_setup_still_fires_on_exception_and_on_fit_end() -> None:
    class BadSetup(Callback):
        def setup(self, loop):
            raise ValueError("cannot set up")

    recorder = EventRecorder()
    loop = _loop(recorder)
    loop.callbacks.append(BadSetup())
    with pytest.raises(ValueError, match="cannot set up") as info:
        loop.fit(1)
    assert recorder.events == [("on_exception", "ValueError"), ("on_fit_end", 0, 0, 0)]
    assert "BadSetup at event setup" in "\n".join(info.value.__notes__)


def test_an_error_in_a_hook_names_the_callback() -> None:
    class BadScale(Callback):
        def scale_loss(self, loop, loss):
            raise RuntimeError("no scaling today")

    loop = _loop(EventRecorder())
    loop.callbacks.append(BadScale())
    with pytest.raises(RuntimeError) as info:
        loop.fit(1)
    assert "BadScale at event scale_loss" in "\n".join(info.value.__notes__)


def test_an_optimizer_without_step_hooks_still_counts_its_steps() -> None:
    class PlainSGD:
        """Duck-typed optimizer: step, zero_grad and param_groups, no hook API."""

        def __init__(self, params, lr):
            self.param_groups = [{"params": list(params), "lr": lr}]

        def step(self):
            with torch.no_grad():
                for p in self.param_groups[0]["params"]:
                    p -= self.param_groups[0]["lr"] * p.grad

        def zero_grad(self, set_to_none=True):
            for p in self.param_groups[0]["params"]:
                p.grad = None

    recorder = EventRecorder()
    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    loop = Loop(model, PlainSGD(model.parameters(), 0.1), data, loss_fn=F.cross_entropy,
                callbacks=[recorder], device="cpu")
    assert loop.fit(5, max_steps=4).step == 4
    assert [event[0] for event in recorder.events].count("after_step") == 4


def test_validate_alone_restores_the_model_mode() -> None:
    loop = _loop(EventRecorder())
    loop.model.train()
    loop.validate()
    assert loop.model.training
    loop.model.eval()
    loop.validate()
    assert not loop.model.training
