"""Numerical faults (AMP's scale, non-finite gradients, poisoned buffers), SIGTERM, and the
rank of a process without a process group. Oracles: hand-written loops and torch itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import subprocess_env
from hookloop import Callback, Loop, distributed
from hookloop.callbacks import AMP, GradAccumulation, TerminateOnNaN
from hookloop.callbacks import amp as amp_module
from hookloop.grads import non_finite_weights_advice
from hookloop.signals import handled
from hookloop.suspension import Vote, published


# ------------------------------------------------------------------------------ AMP
def _poisoned_loop(batches: int, bad: set[int], amp: AMP) -> tuple[Loop, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = []
    for index in range(batches):
        inputs = torch.randn(4, 3)
        if index in bad:
            inputs[0, 0] = float("inf")
        data.append((inputs, torch.randn(4, 1)))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=[amp])
    return loop, model


def test_amp_warns_once_after_many_skipped_steps_and_never_reaches_scale_zero() -> None:
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop, model = _poisoned_loop(210, bad=set(range(200)), amp=amp)
    with pytest.warns(RuntimeWarning) as record:
        loop.fit(1)
    messages = [str(w.message) for w in record if "AMP" in str(w.message)]
    assert len(messages) == 1
    assert f"skipped the last {amp_module.SKIPPED_IN_A_ROW_WARNING} optimizer steps in a row" \
        in messages[0]
    assert "forward pass or the loss itself produces inf/NaN" in messages[0]
    assert amp.skipped_steps == 200
    # Unclamped, 200 halvings of 1024 underflow float32 to exactly 0 (the oracle):
    assert torch.tensor(1024.0) * torch.tensor(0.5) ** 200 == 0
    assert amp.scaler.get_scale() >= amp_module.MIN_SCALE
    # The 10 clean batches after the bad ones were stepped with finite gradients.
    assert loop.state.step == 10
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_amp_does_not_warn_for_a_few_overflows() -> None:
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop, _ = _poisoned_loop(30, bad={3, 4, 5, 20}, amp=amp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loop.fit(1)
    assert amp.skipped_steps == 4 and loop.state.step == 26


# -------------------------------------------------------------------- TerminateOnNaN
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


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(ExplodingGradient.apply(self.linear(inputs))))


def _data(count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(count)]


def _hand(data: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> Net:
    torch.manual_seed(0)
    ExplodingGradient.calls, ExplodingGradient.at = 0, -1
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in data[:steps]:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return model


def _run(data: list[tuple[torch.Tensor, torch.Tensor]], callback: TerminateOnNaN,
         *, poison_call: int = -1, dtype: torch.dtype | None = None) -> Loop:
    torch.manual_seed(0)
    ExplodingGradient.calls, ExplodingGradient.at = 0, poison_call
    model = Net()
    stack: list[Callback] = [AMP(dtype)] if dtype is not None else []
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=nn.functional.mse_loss, device="cpu", callbacks=[*stack, callback])
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
    assert loop.state.step == 3 and "non-finite loss in epoch 0, batch 3" in (loop.stop_reason or "")
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

    torch.manual_seed(0)
    ExplodingGradient.calls, ExplodingGradient.at = 0, -1
    model = Net()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(8),
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[GradAccumulation(2), TerminateOnNaN()])
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


# -------------------------------------------------------------------------- SIGTERM
def test_sigterm_inside_fit_asks_to_end_the_launch_and_the_handler_is_restored() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    assert previous is signal.SIG_DFL
    with published(Vote()) as vote, handled():
        installed = signal.getsignal(signal.SIGTERM)
        assert installed is not signal.SIG_DFL
        with handled():  # nested: installs nothing more
            assert signal.getsignal(signal.SIGTERM) is installed
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs here, raising nothing
                pass
        assert [cause.name for cause in vote.asked] == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_program_handler_for_sigterm_is_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with published(Vote()) as vote, handled():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):
                pass
        assert seen == [signal.SIGTERM] and not vote.asked
    finally:
        signal.signal(signal.SIGTERM, previous)


SIGTERM_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    from hookloop import Callback, Loop
    from hookloop.callbacks import Checkpoint

    class Preempt(Callback):
        def on_batch_end(self, loop):
            if loop.state.step == 5 and not loop.state.epoch and {send}:
                os.kill(os.getpid(), signal.SIGTERM)

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(8)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[Preempt(), Checkpoint(sys.argv[1], resume=True)])
    try:
        loop.fit(2)
    finally:
        print("finally ran", flush=True)
    torch.save(model.state_dict(), os.path.join(sys.argv[1], "..", "final.pt"))
""")


def test_sigterm_during_fit_leaves_a_resumable_checkpoint_and_exits_143(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"

    def run(send: bool, where: Path) -> subprocess.CompletedProcess[str]:
        script = tmp_path / f"train_{send}.py"
        script.write_text(SIGTERM_SCRIPT.replace("{send}", str(send)))
        return subprocess.run([sys.executable, str(script), str(where)], env=subprocess_env(),
                              capture_output=True, text=True, timeout=120, check=False)

    first = run(True, directory)
    assert first.returncode == 143, first.stderr[-3000:]
    assert "finally ran" in first.stdout and "SIGTERM received" in first.stderr
    assert "Traceback" not in first.stderr
    assert sorted(path.name for path in directory.iterdir()) == ["epoch=0000-step=00000005.pt"]
    second = run(False, directory)  # the relaunch resumes and finishes
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    resumed = torch.load(tmp_path / "final.pt", weights_only=True)
    uninterrupted = tmp_path / "plain"
    assert run(False, uninterrupted).returncode == 0
    expected = torch.load(tmp_path / "final.pt", weights_only=True)
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name


# --------------------------------------------------------------------- rank fallback
def test_rank_falls_back_to_torchrun_environment_without_a_group(monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    assert not distributed.is_initialized()
    monkeypatch.setenv("RANK", "1")
    assert distributed.rank() == 1 and not distributed.is_main()
    assert distributed.world_size() == 1  # no collective can run without a group
    monkeypatch.setenv("RANK", "0")
    assert distributed.is_main()
    monkeypatch.delenv("RANK")
    assert distributed.rank() == 0 and distributed.is_main()
