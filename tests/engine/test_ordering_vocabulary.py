"""The ordering vocabulary is small: ``runs_before`` is gone, and a callback that still
declares it is refused before the first batch (not silently ignored), with the fix.

Also: the other names nobody used (AMP's role "precision", ``Monitor.describe``,
``Monitor.requested_mode``, ``distributed.barrier``) are gone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop, distributed
from hookloop.callbacks import AMP
from hookloop.monitor import Monitor


class Counter(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1


class Earlier(Callback):
    runs_before = {"Later": "Later reads what Earlier writes"}  # the removed declaration


class Later(Callback):
    pass


def make_loop(callbacks: list[Callback]) -> Loop:
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2)]
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                device="cpu", callbacks=callbacks)


def test_a_callback_declaring_runs_before_is_refused_with_the_fix() -> None:
    counter = Counter()
    loop = make_loop([counter, Later(), Earlier()])  # the order runs_before meant to forbid
    with pytest.raises(ConfigurationError) as caught:
        loop.fit(1)
    message = str(caught.value)
    assert "Earlier declares runs_before (Later), which hookloop no longer has" in message
    assert "Order the list so that Earlier comes before Later" in message
    assert "runs_after = {'Earlier': 'why'}" in message
    assert counter.batches == 0
    # In the right order it is refused too: the declaration itself is the mistake.
    with pytest.raises(ConfigurationError, match="runs_before"):
        make_loop([Earlier(), Later()]).fit(1)


def test_a_subclass_inheriting_runs_before_is_refused() -> None:
    class Child(Earlier):
        pass

    with pytest.raises(ConfigurationError, match="Child declares runs_before"):
        make_loop([Child()]).fit(1)


def test_the_fix_the_message_gives_works() -> None:
    class Writer(Callback):
        pass

    class Reader(Callback):
        runs_after = {"Writer": "Reader reads what Writer writes"}

    counter = Counter()
    with pytest.raises(CallbackOrderError, match=r"Reader\(\) \(position 1\) must come after "
                                                 r"Writer\(\) \(position 2\)"):
        make_loop([counter, Reader(), Writer()]).fit(1)
    assert counter.batches == 0
    assert make_loop([counter, Writer(), Reader()]).fit(1).step == 2


def test_the_unused_names_are_gone() -> None:
    assert not hasattr(Callback, "runs_before")
    assert AMP.roles == ()
    monitor = Monitor("val_loss", owner="Test")
    assert not hasattr(monitor, "describe") and not hasattr(monitor, "requested_mode")
    assert not hasattr(distributed, "barrier") and "barrier" not in distributed.__all__
