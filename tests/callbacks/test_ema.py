"""EMA against seed 004's hand-written EMA class and hand computations."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import EMA

from builders import make_loop, regression_batches, sgd, two_layers


def make_model(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return two_layers(4, 8, 1, *([nn.BatchNorm1d(8)] if batch_norm else []), nn.Tanh())


def make_data(batches: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(batches, size=8, features=4, seed=seed)


class SeedEMA:
    """Seed 004's EMA class, extended to buffers the way the docs describe."""

    def __init__(self, model: nn.Module, decay: float, buffers: str = "average") -> None:
        self.model, self.decay, self.buffers = model, decay, buffers
        self.shadow = {name: value.detach().clone().float() if value.is_floating_point()
                       else value.detach().clone() for name, value in model.state_dict().items()}
        self.params = {name for name, _ in model.named_parameters()}

    def update(self) -> None:
        for name, value in self.model.state_dict().items():
            average = value.is_floating_point() and (name in self.params or self.buffers == "average")
            if average:
                self.shadow[name] = self.decay * self.shadow[name] + (1.0 - self.decay) * value.float()
            else:
                self.shadow[name] = value.detach().clone()


def hand_loop(data, epochs, decay, every=1, buffers="average", batch_norm=False):  # noqa: ANN001, ANN201
    model = make_model(batch_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema, step = SeedEMA(model, decay, buffers), 0
    for _ in range(epochs):
        model.train()
        for inputs, labels in data:
            F.mse_loss(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % every == 0:
                ema.update()
    return model, ema


def hook_loop(data, epochs, ema, batch_norm=False, val_data=None):  # noqa: ANN001, ANN201
    loop = make_loop([ema], model=make_model(batch_norm), train=data, val=val_data,
                     optimizer=sgd(0.1, momentum=0.9), seed=None)
    loop.fit(epochs)
    return loop.model, loop


@pytest.mark.parametrize("every", [1, 3])
def test_matches_seed_ema(every: int) -> None:
    data = make_data(5)
    model, seed_ema = hand_loop(data, 2, 0.8, every)
    ema = EMA(0.8, warmup=False, every_n_steps=every)
    hook_model, _ = hook_loop(data, 2, ema)
    for p, hand in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)
    averaged = ema.averaged_state_dict()
    assert averaged.keys() == seed_ema.shadow.keys()
    for name, value in seed_ema.shadow.items():
        assert torch.allclose(averaged[name], value, atol=1e-6), name
    assert ema.updates == 10 // every
    assert not torch.allclose(averaged["0.weight"], hook_model[0].weight)  # really averaged


@pytest.mark.parametrize("buffers", ["average", "copy"])
def test_buffers(buffers: str) -> None:
    data = make_data(4)
    _, seed_ema = hand_loop(data, 2, 0.7, buffers=buffers, batch_norm=True)
    ema = EMA(0.7, warmup=False, buffers=buffers)
    hook_model, _ = hook_loop(data, 2, ema, batch_norm=True)
    averaged = ema.averaged_state_dict()
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked", "1.weight"):
        assert torch.allclose(averaged[name].double(), seed_ema.shadow[name].double(), atol=1e-6), name
    assert averaged["1.num_batches_tracked"].dtype == torch.int64
    assert averaged["1.num_batches_tracked"].item() == 8
    if buffers == "copy":
        assert torch.equal(averaged["1.running_mean"], hook_model[1].running_mean)


def test_shadow_is_float32_for_a_half_model() -> None:
    model = make_model().to(torch.bfloat16)
    theta = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    ema = EMA(0.5, warmup=False)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in make_data(1)]
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
         device="cpu", callbacks=[ema]).fit(1)
    averaged = ema.averaged_state_dict()
    for name, p in model.named_parameters():
        assert averaged[name].dtype == torch.float32
        expected = 0.5 * theta[name] + 0.5 * p.detach().float()
        assert torch.allclose(averaged[name], expected, atol=1e-6)


def test_validation_uses_the_ema_weights_and_restores_training_weights() -> None:
    data, val = make_data(4), make_data(2, seed=9)
    hand_model, _ = hand_loop(data, 2, 0.6)
    for validate_with_ema in (True, False):
        ema = EMA(0.6, warmup=False, validate_with_ema=validate_with_ema)
        model, loop = hook_loop(data, 2, ema, val_data=val)
        # Validation ran after epoch 0 too: the training weights came back every time.
        for p, hand in zip(model.parameters(), hand_model.parameters()):
            assert torch.allclose(p, hand, atol=1e-6)
        evaluated = ema.averaged_model() if validate_with_ema else model
        evaluated.eval()
        with torch.no_grad():
            expected = sum(F.mse_loss(evaluated(x), y).double() * len(x) for x, y in val) / 16
        assert loop.state.metrics["val_loss"] == pytest.approx(expected.item(), rel=1e-6)


def test_swapped_restores_on_exception() -> None:
    ema = EMA(0.5, warmup=False)
    model, _ = hook_loop(make_data(3), 1, ema)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    averaged = ema.averaged_state_dict()
    with pytest.raises(RuntimeError, match="boom"):
        with ema.swapped(model):
            for name, value in model.state_dict().items():
                assert torch.equal(value, averaged[name].to(value.dtype))
            raise RuntimeError("boom")
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_copy_to_and_averaged_model() -> None:
    ema = EMA(0.5, warmup=False)
    model, _ = hook_loop(make_data(3), 1, ema)
    target = make_model()
    ema.copy_to(target)
    copy = ema.averaged_model()
    assert not copy.training and copy is not model
    for (name, value), copied in zip(target.state_dict().items(), copy.state_dict().values()):
        assert torch.equal(value, ema.averaged_state_dict()[name])
        assert torch.equal(value, copied)
    fresh = make_model()
    fresh.load_state_dict(ema.averaged_state_dict())  # a plain model state dict


@contextmanager
def no_host_reads():  # noqa: ANN201
    def forbidden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("host sync during the EMA update")
    names = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
    with mock.patch.multiple(torch.Tensor, **{name: forbidden for name in names}):
        yield


def test_update_reads_nothing_back_to_the_host() -> None:
    class Guarded(EMA):
        def after_step(self, loop: Loop) -> None:
            with no_host_reads():
                super().after_step(loop)

    ema = Guarded(0.9, buffers="average")
    hook_loop(make_data(3), 1, ema, batch_norm=True)
    assert ema.updates == 3


def test_state_round_trip_and_placement(tmp_path) -> None:  # noqa: ANN001
    data = make_data(3)
    ema = EMA(0.5, warmup=False)
    hook_loop(data, 1, ema)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    state = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert state["updates"] == 3 and "0.weight" in state["shadow"]

    restored = EMA(0.5, warmup=False)
    restored.load_state_dict(state)  # before any fit: kept until the model is known
    other = make_model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # weights differ from the saved shadow
    Loop(other, torch.optim.SGD(other.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
         device="cpu", callbacks=[restored]).fit(0)
    for name, value in restored.averaged_state_dict().items():
        assert torch.equal(value, state["shadow"][name])  # the loaded shadow, not theta
    assert restored.updates == 3
    assert restored.state_dict()["shadow"].keys() == state["shadow"].keys()


def test_keys_are_the_unwrapped_names() -> None:
    class Compiled(nn.Module):  # stands for torch.compile's wrapper (its _orig_mod)
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self._orig_mod = module

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self._orig_mod(inputs)

    ema = EMA(0.5, warmup=False)
    model = make_model()
    wrapped = Compiled(model)
    assert set(wrapped.state_dict()) != set(model.state_dict())
    Loop(wrapped, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2), loss_fn=F.mse_loss,
         device="cpu", callbacks=[ema]).fit(1)
    assert set(ema.state_dict()["shadow"]) == set(model.state_dict())
    ema.copy_to(wrapped)  # wrapped targets are unwrapped too


def test_mismatched_state_is_reported() -> None:
    ema = EMA(0.5, warmup=False)
    ema.load_state_dict({"shadow": {"nope": torch.zeros(1)}, "updates": 1})
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(1),
                loss_fn=F.mse_loss, device="cpu", callbacks=[ema])
    with pytest.raises(ConfigurationError, match="does not fit the model"):
        loop.fit(1)
    assert loop.state.step == 0


def test_continues_across_fits() -> None:
    data = make_data(3)
    _, seed_ema = hand_loop(data, 2, 0.5)
    ema = EMA(0.5, warmup=False)
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                loss_fn=F.mse_loss, device="cpu", callbacks=[ema])
    loop.fit(1)
    loop.fit(2)
    for name, value in seed_ema.shadow.items():
        assert torch.allclose(ema.averaged_state_dict()[name], value, atol=1e-6)


def test_bad_arguments_and_use_before_fit() -> None:
    with pytest.raises(ConfigurationError, match="decay"):
        EMA(1.5)
    with pytest.raises(ConfigurationError, match="every_n_steps"):
        EMA(every_n_steps=0)
    with pytest.raises(ConfigurationError, match="buffers"):
        EMA(buffers="ignore")
    with pytest.raises(RuntimeError, match="fit"):
        EMA().copy_to(make_model())


def test_skipped_steps_do_not_update() -> None:
    class CancelOdd(Callback):
        def before_step(self, loop: Loop) -> None:
            if loop.state.batch_idx % 2:
                loop.cancel_step()

    ema = EMA(0.5, warmup=False)
    model = make_model()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(6), loss_fn=F.mse_loss,
         device="cpu", callbacks=[CancelOdd(), ema]).fit(1)
    assert ema.updates == 3


def test_a_fit_on_another_loop_is_refused() -> None:
    ema = EMA(0.5, warmup=False)
    hook_loop(make_data(3), 1, ema)
    other = make_model()
    with pytest.raises(ConfigurationError, match="already ran in another Loop"):
        Loop(other, torch.optim.SGD(other.parameters(), lr=0.1), make_data(1),
             loss_fn=F.mse_loss, device="cpu", callbacks=[ema]).fit(0)



# ------------------------------------- validate="both" (issue 33, item 16; timm's script)
def test_validate_both_matches_a_hand_loop_validating_model_and_ema_every_epoch() -> None:
    """A hand-written loop (seed 004's EMA formula, constant decay: warmup=False on both
    sides) validates the model and then its EMA copy after every epoch, as timm's training
    script does; the logged val_* and ema_val_* of every epoch are the hand's."""
    from hookloop.callbacks import EarlyStopping, Metrics

    from builders import accuracy, classification_batches

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = two_layers(5, 16, 3, nn.Tanh())
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    train = classification_batches(5, size=6, seed=1)
    val = classification_batches(3, size=5, seed=2)
    decay, epochs = 0.7, 3

    def scores(model: nn.Module) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            loss = sum(F.cross_entropy(model(x), y).double() * len(x) for x, y in val) / 15
            acc = sum(accuracy(model(x), y).double() * len(x) for x, y in val) / 15
        model.train()
        return loss.item(), acc.item()

    model, optimizer = build()
    ema_copy = {name: value.detach().clone() for name, value in model.state_dict().items()}
    averaged = copy_of(model)
    expected = []
    for _ in range(epochs):
        for x, y in train:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            with torch.no_grad():  # ema = decay * ema + (1 - decay) * theta
                for name, value in model.state_dict().items():
                    ema_copy[name] = decay * ema_copy[name] + (1 - decay) * value.detach()
        averaged.load_state_dict(ema_copy)
        expected.append((*scores(model), *scores(averaged)))

    model, optimizer = build()
    ema = EMA(decay, warmup=False, validate="both")
    stopping = EarlyStopping("ema_val_loss", patience=100)
    loop = Loop(model, optimizer, train, val_data=val, loss_fn=F.cross_entropy, device="cpu",
                callbacks=[Metrics(acc=accuracy), ema, stopping])
    loop.fit(epochs)
    logged = [(row["val_loss"], row["val_acc"], row["ema_val_loss"], row["ema_val_acc"])
              for row in loop.state.history]
    assert len(logged) == epochs
    for got, hand in zip(logged, expected):
        assert got == pytest.approx(hand, abs=1e-6)
    assert logged[-1][0] != pytest.approx(logged[-1][2], abs=1e-4)  # two passes, two weights
    assert stopping.best == pytest.approx(min(row[2] for row in expected), abs=1e-6)


def copy_of(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def test_validate_both_leaves_the_training_as_validate_ema_has_it() -> None:
    """The second pass changes no weight and no random stream: the trained weights and the
    EMA are those of validate="ema" (and val_loss there is ema_val_loss here)."""
    data, val = make_data(4), make_data(2, seed=9)
    runs = {}
    for validate in ("ema", "both"):
        ema = EMA(0.6, validate=validate)
        model, loop = hook_loop(data, 2, ema, val_data=val)
        runs[validate] = (model.state_dict(), ema.averaged_state_dict(), loop.state.metrics)
    for index in (0, 1):
        for name, value in runs["ema"][index].items():
            assert torch.equal(value, runs["both"][index][name])
    assert runs["both"][2]["ema_val_loss"] == runs["ema"][2]["val_loss"]


def test_validate_choices_and_their_contradictions_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"EMA validate must be one of 'ema', 'model', "
                                                 r"'both', got 'yes'"):
        EMA(validate="yes")
    with pytest.raises(ConfigurationError, match=r"validate='both' contradicts "
                                                 r"validate_with_ema=False"):
        EMA(validate_with_ema=False, validate="both")
    assert EMA(validate_with_ema=False).validate == "model"
    assert EMA().validate == "ema" and EMA(validate="both").validate_with_ema is False


def test_a_monitor_of_an_ema_metric_before_the_ema_is_told_to_move() -> None:
    from hookloop import CallbackOrderError
    from hookloop.callbacks import EarlyStopping

    data, val = make_data(2), make_data(1, seed=9)
    loop = make_loop([EarlyStopping("ema_val_loss"), EMA(validate="both")], model=make_model(),
                     train=data, val=val, seed=None)
    with pytest.raises(CallbackOrderError, match=r"ema_val_loss"):
        loop.fit(1)


def test_validate_both_before_a_producer_of_val_metrics_is_told_to_move() -> None:
    """Found in review: with ``[EMA(validate="both"), Metrics]`` the EMA's pass ran inside
    EMA's on_validation_end, before Metrics computed ``val_acc``, which came out as the
    EMA's value. Refused before the first batch, naming the producer; the order the docs
    show trains."""
    from hookloop.callbacks import Metrics

    data, val = make_data(2), make_data(1, seed=9)
    metric = {"neg_mse": lambda outputs, targets: -((outputs - targets) ** 2).mean()}
    loop = make_loop([EMA(validate="both"), Metrics(**metric)], model=make_model(),
                     train=data, val=val, seed=None)
    with pytest.raises(ConfigurationError, match=r"List EMA after Metrics") as refused:
        loop.fit(1)
    assert "validate='both'" in str(refused.value) and loop.state.step == 0
    loop = make_loop([Metrics(**metric), EMA(validate="both")], model=make_model(),
                     train=data, val=val, seed=None)
    loop.fit(1)
    assert {"val_neg_mse", "ema_val_neg_mse"} <= set(loop.state.metrics)
