"""OptimizerStep: a step is counted only when the optimizer really stepped, and a routed
step that never calls the optimizer is refused at the first step boundary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, ConfigurationError, Loop


class ManualSGD(Callback):
    """Routes the step and updates the weights by hand, without loop.optimizer.step()."""

    def __init__(self, say_stepped: bool = False) -> None:
        self.say_stepped = say_stepped

    def optimizer_step(self, loop):
        with torch.no_grad():
            for parameter in loop.model.parameters():
                parameter.add_(parameter.grad, alpha=-0.1)  # what SGD computes
        return True if self.say_stepped else None


class CountAfterStep(Callback):
    def __init__(self) -> None:
        self.count = 0

    def after_step(self, loop):
        self.count += 1


def _loop(callbacks) -> Loop:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=F.cross_entropy, callbacks=callbacks, device="cpu")


def test_a_router_that_never_calls_the_optimizer_is_refused_at_the_first_boundary() -> None:
    loop = _loop([ManualSGD()])
    with pytest.raises(ConfigurationError, match=r"ManualSGD\.optimizer_step returned without "
                       r"calling loop\.optimizer\.step\(\).*return True"):
        loop.fit(2)
    assert loop.state.step == 0


def test_a_router_that_says_it_stepped_is_counted_like_an_optimizer_step() -> None:
    counter = CountAfterStep()
    loop = _loop([ManualSGD(say_stepped=True), counter])
    assert loop.fit(2).step == 6
    assert counter.count == 6
    # The same updates as the optimizer: plain SGD with lr 0.1 by hand.
    reference = _loop([])
    reference.fit(2)
    assert all(torch.equal(a, b) for a, b in zip(loop.model.parameters(),
                                                 reference.model.parameters()))


def test_a_router_that_calls_the_optimizer_is_observed_through_its_hook() -> None:
    class Plain(Callback):
        def optimizer_step(self, loop):
            loop.optimizer.step()

    assert _loop([Plain()]).fit(1).step == 3


class HooksAtStep(Callback):
    """The optimizer's step post hooks as ``after_step`` sees them, at every step."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def after_step(self, loop):
        self.seen.append(len(loop.optimizer._optimizer_step_post_hooks))


def test_an_unrouted_step_pays_no_hook_and_every_step_counts() -> None:
    # The loop's own optimizer.step() stepped once it returned: no step hook watches it
    # (a call per step less, issue 38), and every step is counted as before.
    hooks = HooksAtStep()
    loop = _loop([hooks])
    assert loop.fit(2).step == 6
    assert hooks.seen == [0] * 6
    assert len(loop.optimizer._optimizer_step_post_hooks) == 0  # nothing left behind


def test_a_routed_step_is_watched_by_one_hook_for_the_fit_only() -> None:
    class Plain(Callback):
        def optimizer_step(self, loop):
            loop.optimizer.step()

    hooks = HooksAtStep()
    loop = _loop([Plain(), hooks])
    assert loop.fit(1).step == 3
    assert hooks.seen == [1] * 3
    assert len(loop.optimizer._optimizer_step_post_hooks) == 0
