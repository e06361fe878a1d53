"""The misspelt-event check asks only about attributes that could be called (issue 16, item 5).

A counter named ``after_steps = 0`` or a property named ``on_best`` is data: the loop would
never call it, so its name says nothing about a misspelt event.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, ConfigurationError, Loop


def fit_with(callback: Callback) -> int:
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                device="cpu", callbacks=[callback])
    return loop.fit(1).step


class CountsSteps(Callback):
    """A counter and other data whose names look like events."""

    after_steps = 0
    on_best_value: float | None = None
    before_anything = "a label"
    on_listeners: tuple[str, ...] = ("a", "b")

    def after_step(self, loop: Loop) -> None:
        type(self).after_steps += 1

    @property
    def on_time(self) -> bool:
        return True

    @functools.cached_property
    def after_all(self) -> int:
        return 3


def test_class_attributes_properties_and_cached_properties_are_not_events() -> None:
    CountsSteps.after_steps = 0
    assert fit_with(CountsSteps()) == 2
    assert CountsSteps.after_steps == 2


def _misspelt_function(self: Callback, loop: Loop) -> None:
    pass


class _CallableObject:
    def __call__(self, loop: Loop) -> None:
        pass


@pytest.mark.parametrize("make", [
    lambda: type("Plain", (Callback,), {"on_batch_ends": _misspelt_function}),
    lambda: type("Static", (Callback,), {"on_batch_ends": staticmethod(lambda loop: None)}),
    lambda: type("ClassMethod", (Callback,), {"on_batch_ends": classmethod(_misspelt_function)}),
    lambda: type("CallableObject", (Callback,), {"on_batch_ends": _CallableObject()}),
    lambda: type("Partial", (Callback,), {"on_batch_ends": functools.partialmethod(
        _misspelt_function)}),
], ids=["function", "staticmethod", "classmethod", "callable object", "partialmethod"])
def test_anything_the_loop_could_call_is_still_checked(make) -> None:  # noqa: ANN001
    with pytest.raises(ConfigurationError, match="on_batch_ends looks like an event.*"
                                                 "'on_batch_end'"):
        fit_with(make()())


def test_a_foreign_event_name_on_a_method_is_still_refused() -> None:
    class KerasStyle(Callback):
        def on_train_begin(self, loop: Loop) -> None:
            pass

    with pytest.raises(ConfigurationError, match="rename the method to on_fit_start"):
        fit_with(KerasStyle())
