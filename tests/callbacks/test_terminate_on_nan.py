"""TerminateOnNaN: the non-finite batch never reaches the weights (hand-written loop as oracle),
training stops with a message naming epoch and step, and no NaN checkpoint replaces a good one;
non-finite gradients of a finite loss stop before the step, and poisoned BatchNorm statistics
are put back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import Callback, Loop
from hookloop.callbacks import AMP, Checkpoint, GradAccumulation, TerminateOnNaN
from hookloop.engine.grads import non_finite_weights_advice

from builders import EventRecorder, regression_batches, sgd
from builders import make_loop as build_loop


def batches(bad: int | None, count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = regression_batches(count, seed=0)
    if bad is not None:
        data[bad][1][0, 0] = float("nan")
    return data


def hand_written(data: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                 accumulate: int = 1) -> nn.Module:
    """Plain loop over the first ``steps`` optimizer steps (the finite ones)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done = 0
    for index, (inputs, targets) in enumerate(data):
        if done == steps:
            break
        loss = nn.functional.mse_loss(model(inputs), targets)
        (loss / accumulate).backward()
        if (index + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
            done += 1
    return model


def make_loop(data: list[tuple[torch.Tensor, torch.Tensor]], callbacks: list[Callback]) -> Loop:
    return build_loop(callbacks, train=data, optimizer=sgd(0.1, momentum=0.9))


def test_keeps_the_last_finite_weights_and_stops(capsys: pytest.CaptureFixture[str]) -> None:
    data = batches(bad=3)
    events = EventRecorder()
    loop = make_loop(data, [TerminateOnNaN(), events])
    state = loop.fit(5)
    expected = hand_written(data, steps=3)
    assert torch.equal(loop.model.weight, expected.weight)
    assert torch.equal(loop.model.bias, expected.bias)
    assert state.step == 3 and state.epoch == 0 and state.batch_idx == 3
    assert events.labels("on_epoch_end", "on_fit_end") == ["on_epoch_end", "on_fit_end"]
    message = loop.stop_reason or ""
    assert "epoch 1" in message and "batch 3" in message and "step 4" in message
    assert message in capsys.readouterr().out


def test_with_accumulation_one_sync_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    data = batches(bad=5, count=8)  # windows of 2: the NaN is in the third window
    reads = [0]
    real_item = torch.Tensor.item

    def item(self: torch.Tensor) -> object:
        reads[0] += 1
        return real_item(self)

    loop = make_loop(data, [GradAccumulation(2), TerminateOnNaN()])
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "item", item)
        loop.fit(1)
    expected = hand_written(data, steps=2, accumulate=2)
    assert torch.equal(loop.model.weight, expected.weight)
    assert loop.state.step == 2
    assert "accumulation window ending at batch 5" in (loop.stop_reason or "")
    assert reads[0] == 3  # one read per step boundary reached, none per micro-batch


def test_no_nan_checkpoint_replaces_a_good_one(tmp_path: Path) -> None:
    data = batches(bad=3)
    checkpoint = Checkpoint(tmp_path, every_n_steps=1, keep_last=1)
    loop = make_loop(data, [TerminateOnNaN(), checkpoint])
    loop.fit(5)
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["epoch=0000-step=00000003.pt"]
    saved = torch.load(tmp_path / files[0], weights_only=True)
    expected = hand_written(data, steps=3)
    assert torch.equal(saved["model"]["weight"], expected.weight)
    assert saved["loop"]["step"] == 3


def test_without_terminate_on_nan_checkpoint_refuses_nan_weights(tmp_path: Path) -> None:
    data = batches(bad=3)
    loop = make_loop(data, [Checkpoint(tmp_path, every_n_steps=1, keep_last=1)])
    with pytest.warns(RuntimeWarning, match="not finite") as caught:
        loop.fit(2)
    said = [str(item.message) for item in caught if "not finite" in str(item.message)]
    # Once, though every later step's weights are NaN too; advising for this stack.
    assert len(said) == 1 and "Add TerminateOnNaN()" in said[0], said
    assert torch.isnan(loop.model.weight).all()
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == ["epoch=0000-step=00000003.pt"]  # the last good file, not pruned
    saved = torch.load(tmp_path / files[0], weights_only=True)
    assert torch.isfinite(saved["model"]["weight"]).all()


def test_finite_run_is_untouched() -> None:
    data = batches(bad=None)
    loop = make_loop(data, [TerminateOnNaN()])
    loop.fit(1)
    expected = hand_written(data, steps=6)
    assert torch.equal(loop.model.weight, expected.weight)
    assert not loop.stop_requested


def test_raise_error_raises_after_skipping_the_step_and_checkpoint_saves_the_good_one(
        tmp_path: Path) -> None:
    from hookloop import NonFiniteError

    data = batches(bad=3)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[TerminateOnNaN(raise_error=True), Checkpoint(tmp_path)])
    with pytest.raises(NonFiniteError, match="non-finite loss in epoch 1, batch 3.*after step 3"):
        loop.fit(2)
    expected = hand_written(data, steps=3)
    for ours, theirs in zip(model.parameters(), expected.parameters()):
        assert torch.equal(ours, theirs)
    saved = torch.load(tmp_path / "epoch=0000-step=00000003.pt", weights_only=True)
    assert torch.equal(saved["model"]["weight"], expected.weight)


def test_raise_error_must_be_a_bool() -> None:
    from hookloop import ConfigurationError

    with pytest.raises(ConfigurationError, match="raise_error must be True or False"):
        TerminateOnNaN(raise_error="yes")


# ---------------------------------------------- non-finite gradients, a finite loss


class ExplodingGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite); a NaN gradient at one chosen call."""

    calls = 0
    at = -1

    @staticmethod
    def forward(ctx, value):
        ExplodingGradient.calls += 1
        ctx.poison = ExplodingGradient.calls == ExplodingGradient.at
        return value.view_as(value)

    @staticmethod
    def backward(ctx, gradient):
        return gradient * float("nan") if ctx.poison else gradient


class NaNGradientNet(nn.Module):
    """Linear, BatchNorm, Linear; `ExplodingGradient` between them poisons one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(ExplodingGradient.apply(self.linear(inputs))))


def _data(count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(count, seed=1)


def _hand(data: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> NaNGradientNet:
    torch.manual_seed(0)
    ExplodingGradient.calls, ExplodingGradient.at = 0, -1
    model = NaNGradientNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in data[:steps]:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return model


def _run(data: list[tuple[torch.Tensor, torch.Tensor]], callback: TerminateOnNaN,
         *, poison_call: int = -1, dtype: torch.dtype | None = None) -> Loop:
    ExplodingGradient.calls, ExplodingGradient.at = 0, poison_call
    stack: list[Callback] = [AMP(dtype)] if dtype is not None else []
    loop = build_loop([*stack, callback], model=NaNGradientNet, train=data)
    loop.fit(3)
    return loop


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_non_finite_gradients_with_a_finite_loss_stop_before_the_step(dtype: torch.dtype | None
                                                                      ) -> None:
    data = _data()
    loop = _run(data, TerminateOnNaN(), poison_call=3, dtype=dtype)
    assert loop.state.step == 2 and loop.state.epoch == 0
    message = loop.stop_reason or ""
    assert "non-finite gradients (with a finite loss)" in message
    assert "parameters are those after step 2" in message
    if dtype is None:  # fp32: exactly the hand loop's first two steps
        expected = _hand(data, steps=2)
        for name, value in expected.state_dict().items():
            assert torch.equal(loop.model.state_dict()[name], value), name


def test_check_gradients_false_lets_them_through() -> None:
    loop = _run(_data(), TerminateOnNaN(check_gradients=False), poison_call=3)
    # The NaN gradients of step 3 reached the weights; the next loss is what stops it.
    assert loop.state.step == 3 and "non-finite loss in epoch 1, batch 3" in (loop.stop_reason or "")
    assert not torch.isfinite(loop.model.linear.weight).all()
    assert "check_gradients=False" in non_finite_weights_advice([TerminateOnNaN(check_gradients=False)])
    assert "Add TerminateOnNaN()" in non_finite_weights_advice([])
    assert "is in the stack" in non_finite_weights_advice([TerminateOnNaN()])


def test_batchnorm_statistics_poisoned_by_a_nan_forward_are_restored() -> None:
    data = _data()
    data[2][0][1, 1] = float("nan")  # a NaN input: the running statistics take it in forward
    loop = _run(data, TerminateOnNaN())
    expected = _hand(data, steps=2)
    state = loop.model.state_dict()
    for name, value in expected.state_dict().items():
        assert torch.equal(state[name], value), name  # num_batches_tracked included
    assert "buffers (BatchNorm statistics) were put back" in (loop.stop_reason or "")
    # The documented limit without restoring: the statistics are NaN.
    unrestored = _run(data, TerminateOnNaN(restore_buffers=False))
    assert torch.isnan(unrestored.model.norm.running_mean).any()
    assert "may hold values of the bad forward pass" in (unrestored.stop_reason or "")


def test_one_host_read_per_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [0]
    real_item = torch.Tensor.item

    def item(self: torch.Tensor) -> object:
        reads[0] += 1
        return real_item(self)

    ExplodingGradient.calls, ExplodingGradient.at = 0, -1
    loop = build_loop([GradAccumulation(2), TerminateOnNaN()], model=NaNGradientNet,
                      train=_data(8))
    model = loop.model
    for name in ("tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name: pytest.fail(_n))
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "item", item)
        loop.model.train()
        loop._setup()
        # Only the callback's own reads: run its events by hand around plain steps.
        callback = loop.callbacks[1]
        callback.on_fit_start(loop)
        for index, (inputs, targets) in enumerate(_data(8)):
            callback.on_batch_start(loop)
            loop.state.loss = nn.functional.mse_loss(model(inputs), targets)
            callback.after_forward(loop)
            loop.state.loss.backward()
            if index % 2 == 1:
                callback.before_step(loop)
    assert reads[0] == 4  # 8 micro-batches, 4 step boundaries


@pytest.mark.parametrize("arguments", [("x",), (True,)])
def test_terminate_on_nan_rejects_positional_arguments(arguments: tuple[object, ...]) -> None:
    from hookloop import ConfigurationError

    with pytest.raises(ConfigurationError, match="no positional arguments"):
        TerminateOnNaN(*arguments)
    with pytest.raises(ConfigurationError, match="check_gradients must be True or False"):
        TerminateOnNaN(check_gradients="yes")  # type: ignore[arg-type]


def test_the_non_finite_warning_advises_for_the_stack_that_runs(tmp_path: Path) -> None:
    """Weights made NaN behind TerminateOnNaN's back (after its checks): the skipped save's
    warning says that TerminateOnNaN is in the stack, not to add it."""

    class Poison(Callback):
        def on_batch_end(self, loop: Loop) -> None:
            if loop.state.step == 3 and loop.state.step_boundary:
                with torch.no_grad():
                    loop.model.weight.fill_(float("nan"))

    loop = make_loop(batches(bad=None), [TerminateOnNaN(), Poison(),
                                         Checkpoint(tmp_path, every_n_steps=1, keep_last=1)])
    with pytest.warns(RuntimeWarning, match="not finite") as caught:
        loop.fit(1)
    said = [str(item.message) for item in caught if "not finite" in str(item.message)]
    assert len(said) == 1 and "is in the stack" in said[0], said
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=0000-step=00000002.pt"]
