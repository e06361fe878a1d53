"""GradClip against hand-written clip_grad_norm_ / clip_grad_value_ loops (seed 004)."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop
from hookloop.callbacks import AMP, GradClip

from builders import BatchCounter, make_loop, regression_batches, two_layers


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return two_layers(5, 12, 1, nn.ReLU())


def make_data(batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Targets of scale 3: gradients large enough for the limits below to cut.
    return [(inputs, 3 * targets)
            for inputs, targets in regression_batches(batches, size=8, features=5, seed=2)]


def hand_norm(model: nn.Module, norm_type: float) -> torch.Tensor:
    norms = [torch.linalg.vector_norm(p.grad, norm_type) for p in model.parameters()]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_by_value_matches_hand_loop(norm_type: float) -> None:
    data, max_value = make_data(6), 0.05
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    norms = []
    for _ in range(2):
        for inputs, labels in data:
            F.mse_loss(model(inputs), labels).backward()
            norms.append(hand_norm(model, norm_type))
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=max_value)
            optimizer.step()
            optimizer.zero_grad()

    hook_model = make_model()
    recorded: list[torch.Tensor] = []

    class Norms(Callback):
        def after_step(self, loop: Loop) -> None:
            recorded.append(loop.state.grad_norm)

    Loop(hook_model, torch.optim.SGD(hook_model.parameters(), lr=0.1, momentum=0.5), data,
         loss_fn=F.mse_loss, device="cpu",
         callbacks=[GradClip(max_value=max_value, norm_type=norm_type), Norms()]).fit(2)
    for p, hand in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)
    assert all(isinstance(norm, torch.Tensor) and norm.dim() == 0 for norm in recorded)
    assert torch.allclose(torch.stack(recorded), torch.stack(norms), atol=1e-5)
    assert max(norms) > max_value  # clipping really happened


def test_clip_by_norm_matches_hand_loop_and_keeps_the_pre_clip_norm() -> None:
    data, max_norm = make_data(5), 0.5
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    norms = []
    for inputs, labels in data:
        F.mse_loss(model(inputs), labels).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
        optimizer.zero_grad()
    hook_model = make_model()
    recorded: list[torch.Tensor] = []

    class Norms(Callback):
        def after_step(self, loop: Loop) -> None:
            recorded.append(loop.state.grad_norm)

    Loop(hook_model, torch.optim.SGD(hook_model.parameters(), lr=0.05), data,
         loss_fn=F.mse_loss, device="cpu", callbacks=[GradClip(max_norm), Norms()]).fit(1)
    for p, hand in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)
    assert torch.allclose(torch.stack(recorded), torch.stack(norms), atol=1e-6)
    assert min(norms) > max_norm


@contextmanager
def no_host_reads():  # noqa: ANN201
    """Fail on any method that copies a tensor value to the host (a sync on CUDA)."""
    def forbidden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("host sync during the update")
    names = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
    with mock.patch.multiple(torch.Tensor, **{name: forbidden for name in names}):
        yield


class GuardedClip(GradClip):
    def before_step(self, loop: Loop) -> None:
        with no_host_reads():
            super().before_step(loop)


@pytest.mark.parametrize("kwargs", [{"max_norm": 1.0}, {"max_value": 0.1}])
def test_clipping_reads_nothing_back_to_the_host(kwargs: dict) -> None:
    model = make_model()
    state = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2),
                 loss_fn=F.mse_loss, device="cpu", callbacks=[GuardedClip(**kwargs)]).fit(1)
    assert state.grad_norm is not None


def test_clip_before_amp_is_rejected_before_the_first_batch() -> None:
    counter = BatchCounter()
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2),
                loss_fn=F.mse_loss, device="cpu",
                callbacks=[GradClip(1.0), AMP(torch.float16), counter])
    with pytest.raises(CallbackOrderError, match=r"GradClip.*AMP|AMP.*GradClip"):
        loop.fit(1)
    assert counter.batches == 0


def test_exactly_one_limit() -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        GradClip()
    with pytest.raises(ConfigurationError, match="exactly one"):
        GradClip(1.0, max_value=0.5)
    with pytest.raises(ConfigurationError, match=r"GradClip max_norm must be a finite number > 0 or None, got 0\.0\."):
        GradClip(0.0)
    with pytest.raises(ConfigurationError, match="norm_type"):
        GradClip(1.0, norm_type=-1)


def test_stateless() -> None:
    assert GradClip(1.0).state_dict() == {}


def detached_loop(clip: GradClip) -> tuple[Loop, nn.Module]:
    """The optimizer holds `model`, but the loss reaches it only through a detached graph."""
    model = make_model()
    torch.manual_seed(1)
    head = nn.Linear(1, 1)  # trainable, not in the optimizer: backward still runs

    def forward(loop: Loop, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        inputs, labels = batch
        outputs = head(loop.model(inputs).detach())
        return outputs, F.mse_loss(outputs, labels)

    loop = make_loop([clip], model=model, train=make_data(3), forward=forward, loss_fn=None,
                     seed=None)
    return loop, model


@pytest.mark.parametrize("kwargs", [{"max_norm": 1.0}, {"max_value": 0.1}])
def test_every_grad_none_warns_once_naming_gradclip_and_the_causes(kwargs: dict) -> None:
    loop, model = detached_loop(GuardedClip(**kwargs))  # the check itself reads nothing back
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning) as caught:
        state = loop.fit(2)  # 6 steps with no gradient: one warning
    messages = [str(w.message) for w in caught if "GradClip" in str(w.message)]
    assert len(messages) == 1, messages
    assert "at step 0" in messages[0] and ".grad None" in messages[0]
    assert "detach" in messages[0] and "requires_grad=False" in messages[0]
    assert state.step == 6
    assert state.grad_norm.dim() == 0 and float(state.grad_norm) == 0.0  # nothing clipped
    # Hand oracle: nothing reached the optimized parameters, so nothing changed.
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_no_warning_when_gradients_exist() -> None:
    import warnings

    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2),
             loss_fn=F.mse_loss, device="cpu", callbacks=[GradClip(1.0)]).fit(1)
