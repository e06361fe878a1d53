"""Stack checks at fit start: each error is raised before the first batch and names the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop
from hookloop import describe

from builders import BatchCounter, classification_batches, make_loop


class Producer(Callback):
    def produces(self, loop):
        return ["val_score"]


class Monitor(Callback):
    def monitors(self):
        return ["val_score"]


class Unscaler(Callback):
    unique = True


class Clipper(Callback):
    runs_after = {"Unscaler": "Unscaler unscales the gradients before they are clipped"}


class Saver(Callback):
    runs_after = {"stateful": "Saver saves the state of the callbacks before it"}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Counter(Callback):
    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        pass


def _fit(callbacks, val=True):
    counter = BatchCounter()
    loop = make_loop([counter, *callbacks], model=lambda: torch.nn.Linear(3, 2),
                     train=lambda: classification_batches(1, features=3, classes=2),
                     val=(lambda train: train) if val else None, loss_fn=F.cross_entropy,
                     seed=None)
    try:
        loop.fit(1)
    except Exception:
        assert counter.batches == 0, "the error must come before the first batch"
        raise


def test_wrong_order_names_both_callbacks_and_a_legal_order() -> None:
    with pytest.raises(CallbackOrderError) as info:
        _fit([Clipper(), Unscaler()])
    message = str(info.value)
    assert "Clipper() (position 1) must come after Unscaler() (position 2)" in message
    assert "unscales the gradients" in message
    assert "[BatchCounter(), Unscaler(), Clipper()]" in message


def test_monitor_before_its_producer_is_an_order_error() -> None:
    with pytest.raises(CallbackOrderError, match=r"Monitor\(\) .* must come after Producer\(\)"):
        _fit([Monitor(), Producer()])
    _fit([Producer(), Monitor()])  # the right order passes


def test_monitored_metric_nothing_produces_lists_the_available_ones() -> None:
    with pytest.raises(CallbackOrderError) as info:
        _fit([Monitor()])
    message = str(info.value)
    assert "'val_score'" in message and "Available metrics: train_loss, val_loss" in message


def test_validation_metric_without_val_data_hints_at_val_data() -> None:
    class WatchVal(Callback):
        def monitors(self):
            return ["val_loss"]

    with pytest.raises(CallbackOrderError, match="val_data="):
        _fit([WatchVal()], val=False)


def test_two_stateful_callbacks_with_one_key_clash() -> None:
    with pytest.raises(CallbackOrderError) as info:
        _fit([Counter(), Counter()])
    assert "'Counter'" in str(info.value) and "name=" in str(info.value)
    renamed = Counter()
    renamed.name = "other"
    _fit([Counter(), renamed])


def test_role_constraint_puts_state_savers_last() -> None:
    with pytest.raises(CallbackOrderError, match=r"Counter\(\) .* must come after|Saver"):
        _fit([Saver(), Counter()])
    _fit([Counter(), Saver()])


def test_unique_callback_twice() -> None:
    with pytest.raises(CallbackOrderError, match="only once"):
        _fit([Unscaler(), Unscaler()])


def test_two_callbacks_routing_the_step() -> None:
    class StepA(Callback):
        def optimizer_step(self, loop):
            loop.optimizer.step()

    class StepB(StepA):
        pass

    with pytest.raises(CallbackOrderError, match="both take the optimizer step"):
        _fit([StepA(), StepB()])


def test_conflicting_callbacks() -> None:
    class Exclusive(Callback):
        conflicts_with = {"Producer": "both write val_score"}

    with pytest.raises(CallbackOrderError, match="cannot be used with Producer"):
        _fit([Exclusive(), Producer()])


@pytest.mark.parametrize("method,suggestion", [("on_batch_begin", "on_batch_start"),
                                               ("after_loss", "after_forward"),
                                               ("on_train_end", "on_fit_end")])
def test_misnamed_event_is_reported_with_a_suggestion(method, suggestion) -> None:
    Typo = type("Typo", (Callback,), {method: lambda self, loop: None})
    with pytest.raises(ConfigurationError) as info:
        _fit([Typo()])
    message = str(info.value)
    assert f"Typo.{method}" in message and "never be called" in message
    assert suggestion in message


def test_class_instead_of_instance() -> None:
    with pytest.raises(ConfigurationError, match=r"class Producer, not an instance.*Producer\(...\)"):
        _fit([Producer])


def test_non_callback_object() -> None:
    with pytest.raises(ConfigurationError, match="not a hookloop.Callback"):
        _fit([print])


def test_describe_shows_events_in_firing_order_and_listener_positions() -> None:
    class First(Callback):
        def before_step(self, loop):
            pass

        def on_fit_start(self, loop):
            pass

    class Second(Callback):
        rank_zero_only = True

        def before_step(self, loop):
            pass

        def forward_context(self, loop):
            return None

    text = describe([First(), Second()], print_table=False)
    lines = text.splitlines()
    header = next(line for line in lines if "┃ event" in line)
    assert [cell.strip() for cell in header.split("┃")[2:-1]] == ["0", "1"]
    assert "0: First()" in lines and "1: Second() (rank 0 only)" in lines  # the legend
    assert max(map(len, lines)) <= 80
    row = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
           for line in lines if line.startswith("│") and line.split("│")[1].strip()}
    assert row["before_step"] == ["1", "2"]
    assert row["on_fit_start"] == ["1", ""]
    assert row["forward_context"] == ["", "1"]
    assert row["after_step"] == ["", ""]
    event_rows = [name for name in row if name in {"on_fit_start", "on_batch_start", "before_step",
                                                    "on_validation_end", "on_fit_end"}]
    assert event_rows == ["on_fit_start", "on_batch_start", "before_step", "on_validation_end",
                          "on_fit_end"]


def test_loop_describe_prints_the_same_table(capsys) -> None:
    model = torch.nn.Linear(3, 2)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], callbacks=[Producer()])
    text = loop.describe()
    assert "Producer()" in text and "Producer()" in capsys.readouterr().out
