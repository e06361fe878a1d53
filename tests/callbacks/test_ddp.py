"""The DDP callback in one process: a no-op outside torchrun, and no_sync inside an
accumulation window. The samplers and loaders it builds are tested in test_samplers.py; two
real processes under torchrun are in tests/distributed/."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from builders import assert_close_weights, make_loop, sgd
from conftest import ROOT
from torch import nn
from torch.utils.data import DataLoader

from hookloop import Loop
from hookloop.callbacks import DDP

sys.path.insert(0, str(ROOT / "tests" / "distributed" / "scripts"))
import common


def _plain_loop(callbacks: list[Any]) -> tuple[Loop, nn.Module, DataLoader]:
    data = DataLoader(common.regression_data(12, seed=2), batch_size=4)
    loop = make_loop(callbacks, model=common.make_model(seed=1), train=data,
                     optimizer=sgd(0.05, momentum=0.9), seed=None)  # common.make_optimizer's
    return loop, loop.model, data


def test_outside_torchrun_ddp_does_nothing_and_says_so_once(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    loop, model, data = _plain_loop([DDP()])
    with pytest.warns(UserWarning, match="not launched by torchrun") as record:
        loop.fit(1)
        loop.fit(2)
    assert len([w for w in record if "torchrun" in str(w.message)]) == 1
    assert loop.model is model and loop.train_data is data
    # The same training as a hand loop over the same batches.
    expected = common.make_model(seed=1)
    optimizer = common.make_optimizer(expected)
    inputs, targets = common.regression_data(12, seed=2).tensors
    for _ in range(2):
        for start in range(0, 12, 4):
            optimizer.zero_grad()
            nn.functional.mse_loss(expected(inputs[start:start + 4]),
                                   targets[start:start + 4]).backward()
            optimizer.step()
    assert_close_weights(model.state_dict(), expected.state_dict(), atol=0)


def test_train_step_context_is_no_sync_inside_a_window_only() -> None:
    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self) -> None:  # no process group needed to test the choice
            nn.Module.__init__(self)

        def no_sync(self) -> str:  # type: ignore[override]
            return "no_sync"

    loop, _, _ = _plain_loop([])
    loop.model = FakeDDP()
    callback = DDP()
    loop.state.step_boundary = False
    assert callback.train_step_context(loop) == "no_sync"
    loop.state.step_boundary = True
    assert callback.train_step_context(loop) is None
