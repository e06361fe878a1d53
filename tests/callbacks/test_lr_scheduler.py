"""LRScheduler against hand-written scheduler loops (seed 004: Plateau, OneCycle, per-epoch)."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop
from hookloop.callbacks import GradAccumulation, LRScheduler
from hookloop.schedules import warmup_cosine

from builders import regression_batches, two_layers


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return two_layers(4, 8, 1, nn.Tanh())


def make_data(batches: int, seed: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(batches, size=6, features=4, seed=seed)


class LRLog(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.batches = 0

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1

    def on_epoch_end(self, loop: Loop) -> None:
        self.lrs.append(loop.optimizer.param_groups[0]["lr"])


def assert_same_weights(model: nn.Module, hand: nn.Module) -> None:
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_reduce_on_plateau_on_a_validation_metric_matches_hand_loop() -> None:
    data, val, epochs = make_data(4), make_data(2, seed=8), 5
    settings = dict(mode="min", factor=0.5, patience=0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler = lr_scheduler.ReduceLROnPlateau(optimizer, **settings)
    hand_lrs = []
    for _ in range(epochs):
        model.train()
        for inputs, labels in data:
            F.mse_loss(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            val_loss = sum(F.mse_loss(model(x), y).item() * len(x) for x, y in val) / 12
        scheduler.step(val_loss)
        hand_lrs.append(optimizer.param_groups[0]["lr"])

    hook_model = make_model()
    hook_optimizer = torch.optim.SGD(hook_model.parameters(), lr=0.2)
    log = LRLog()
    callback = LRScheduler(lr_scheduler.ReduceLROnPlateau(hook_optimizer, **settings),
                           monitor="val_loss")
    loop = Loop(hook_model, hook_optimizer, data, val_data=val, loss_fn=F.mse_loss, device="cpu",
                callbacks=[callback, log])
    loop.fit(epochs)
    assert list(callback.monitors()) == ["val_loss"]
    assert log.lrs == hand_lrs
    assert min(hand_lrs) < 0.2  # the plateau rule fired
    assert_same_weights(hook_model, model)
    loop.validate()  # a standalone validation does not step the plateau scheduler
    assert callback.scheduler.last_epoch == epochs


def test_one_cycle_through_the_factory_matches_hand_loop() -> None:
    data, k, epochs = make_data(10), 2, 3
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    total = math.ceil(len(data) / k) * epochs
    scheduler = lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    for _ in range(epochs):
        for batch_idx, (inputs, labels) in enumerate(data):
            (F.mse_loss(model(inputs), labels) / k).backward()
            if (batch_idx + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()

    totals: list[int] = []

    def factory(optimizer: torch.optim.Optimizer, total_steps: int) -> lr_scheduler.OneCycleLR:
        totals.append(total_steps)
        return lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)

    hook_model = make_model()
    callback = LRScheduler(factory)
    Loop(hook_model, torch.optim.SGD(hook_model.parameters(), lr=0.01, momentum=0.9), data,
         loss_fn=F.mse_loss, device="cpu", callbacks=[GradAccumulation(k), callback]).fit(epochs)
    assert totals == [total] == [15]
    assert callback.scheduler.last_epoch == total
    assert_same_weights(hook_model, model)


def test_warmup_cosine_factory_matches_a_manual_lr_loop() -> None:
    """Seed 000's manual warmup, then the cosine, set by hand before every step."""
    data, epochs, base, warmup = make_data(5), 2, 0.1, 3
    total = len(data) * epochs
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=base)
    global_step = 0
    for _ in range(epochs):
        for inputs, labels in data:
            if global_step < warmup:
                lr = base * global_step / warmup
            else:
                progress = (global_step - warmup) / (total - warmup)
                lr = base * 0.5 * (1 + math.cos(math.pi * progress))
            for group in optimizer.param_groups:
                group["lr"] = lr
            F.mse_loss(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
    hook_model = make_model()
    Loop(hook_model, torch.optim.SGD(hook_model.parameters(), lr=base), data, loss_fn=F.mse_loss,
         device="cpu",
         callbacks=[LRScheduler(functools.partial(warmup_cosine, warmup_steps=warmup))]).fit(epochs)
    assert_same_weights(hook_model, model)


def test_epoch_interval_matches_hand_loop() -> None:
    data, epochs = make_data(3), 4
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(epochs):
        for inputs, labels in data:
            F.mse_loss(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
    hook_model = make_model()
    hook_optimizer = torch.optim.SGD(hook_model.parameters(), lr=0.1)
    callback = LRScheduler(lr_scheduler.StepLR(hook_optimizer, step_size=1, gamma=0.5),
                           interval="epoch")
    Loop(hook_model, hook_optimizer, data, loss_fn=F.mse_loss, device="cpu",
         callbacks=[callback]).fit(epochs)
    assert hook_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 16)
    assert_same_weights(hook_model, model)


def test_plateau_without_validation_reads_train_loss_at_epoch_end() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = LRScheduler(lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", patience=0),
                           monitor="train_loss")
    Loop(model, optimizer, make_data(3), loss_fn=F.mse_loss, device="cpu",
         callbacks=[callback]).fit(3)
    assert callback.scheduler.last_epoch == 3


def test_cancelled_steps_do_not_advance_a_step_scheduler() -> None:
    class CancelFirst(Callback):
        def before_step(self, loop: Loop) -> None:
            if loop.state.batch_idx == 0:
                loop.cancel_step()

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = LRScheduler(lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    state = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                 callbacks=[CancelFirst(), callback]).fit(1)
    assert state.step == 3 and callback.scheduler.last_epoch == 3


def test_factory_is_rebuilt_when_a_later_fit_has_more_steps() -> None:
    model = make_model()
    callback = LRScheduler(lambda opt, total: lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                                      total_steps=total))
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(4),
                loss_fn=F.mse_loss, device="cpu", callbacks=[callback])
    loop.fit(0)
    assert callback.scheduler is None  # nothing to schedule yet
    loop.fit(1)
    first = callback.scheduler
    loop.fit(3)  # would step past a 4-step OneCycleLR
    assert callback.scheduler is not first
    assert callback.scheduler.total_steps == 12 and callback.scheduler.last_epoch == 12


def test_errors_before_the_first_batch() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="interval"):
        LRScheduler(lr_scheduler.StepLR(optimizer, 1), interval="batch")
    with pytest.raises(ConfigurationError, match="monitor"):
        LRScheduler(lr_scheduler.ReduceLROnPlateau(optimizer))
    with pytest.raises(ConfigurationError, match="only used by ReduceLROnPlateau"):
        LRScheduler(lr_scheduler.StepLR(optimizer, 1), monitor="val_loss")
    with pytest.raises(ConfigurationError, match="factory"):
        LRScheduler(42)  # type: ignore[arg-type]

    class Stream:
        def __iter__(self):  # noqa: ANN204
            return iter(make_data(2))

    cases = [
        (Stream(), None, LRScheduler(lambda opt, total: lr_scheduler.StepLR(opt, 1)),
         ConfigurationError, "max_steps"),
        (make_data(2), None, LRScheduler(lambda opt, total: lr_scheduler.ReduceLROnPlateau(opt)),
         ConfigurationError, "monitor"),
        (make_data(2), None, LRScheduler(lr_scheduler.ReduceLROnPlateau(optimizer),
                                         monitor="val_acc"), CallbackOrderError, "val_acc"),
        (make_data(2), None, LRScheduler(lr_scheduler.StepLR(
            torch.optim.SGD(make_model().parameters(), lr=0.1), 1)), ConfigurationError,
         "another optimizer"),
    ]
    for data, _, callback, error, message in cases:
        log = LRLog()
        loop = Loop(model, optimizer, data, loss_fn=F.mse_loss, device="cpu",
                    callbacks=[callback, log])
        with pytest.raises(error, match=message):
            loop.fit(1)
        assert log.batches == 0


def test_unsized_data_with_max_steps_builds_the_factory() -> None:
    class Stream:
        def __iter__(self):  # noqa: ANN204
            return iter(make_data(3))

    totals: list[int] = []

    def factory(optimizer: torch.optim.Optimizer, total_steps: int) -> lr_scheduler.StepLR:
        totals.append(total_steps)
        return lr_scheduler.StepLR(optimizer, 1)

    model = make_model()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), Stream(), loss_fn=F.mse_loss,
         device="cpu", callbacks=[LRScheduler(factory)]).fit(5, max_steps=7)
    assert totals == [7]


def test_state_round_trip(tmp_path) -> None:  # noqa: ANN001
    data = make_data(4)
    factory = functools.partial(warmup_cosine, warmup_steps=0.25, min_lr=0.01)
    model = make_model()
    callback = LRScheduler(factory)
    first = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                 device="cpu", callbacks=[callback])
    first.fit(1, max_steps=3)
    torch.save(callback.state_dict(), tmp_path / "sched.pt")
    state = torch.load(tmp_path / "sched.pt", weights_only=True)
    # The scheduler's own state, and the total the factory built it for (for a relaunch
    # that stretches the schedule, which says so).
    assert state == {**callback.scheduler.state_dict(), "factory_total_steps": 3}
    assert state["last_epoch"] == 3

    # A new process: the loop restores the run (the schedule included) after setup.
    saved = first.state_dict()
    restored = LRScheduler(factory)
    other = make_model()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    loop = Loop(other, optimizer, data, loss_fn=F.mse_loss, device="cpu", callbacks=[restored])
    loop.load_state_dict(saved)  # resume at step 3 of 3: that run has ended
    log = LRLog()
    loop.callbacks.append(log)
    loop.fit(1, max_steps=3)
    assert log.batches == 0
    assert restored.scheduler.last_epoch == 3
    assert restored.scheduler.get_last_lr() == callback.scheduler.get_last_lr()
    assert optimizer.param_groups[0]["lr"] == callback.scheduler.get_last_lr()[0]


def test_a_callback_stays_with_the_loop_it_first_ran_in() -> None:
    callback = LRScheduler(functools.partial(warmup_cosine, warmup_steps=2))
    model = make_model()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(4), loss_fn=F.mse_loss,
         device="cpu", callbacks=[callback]).fit(1)
    other = make_model()
    with pytest.raises(ConfigurationError, match="already ran in another Loop"):
        Loop(other, torch.optim.SGD(other.parameters(), lr=0.1), make_data(4),
             loss_fn=F.mse_loss, device="cpu", callbacks=[callback]).fit(1)


# ----------------------------------------------- hand-built fixed-length schedulers
def one_cycle_loop(total_steps: int, batches: int = 4, **kwargs) -> tuple[Loop, LRLog]:  # noqa: ANN003
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = LRLog()
    scheduler = lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)
    loop = Loop(model, optimizer, make_data(batches), loss_fn=F.mse_loss, device="cpu",
                callbacks=[LRScheduler(scheduler, **kwargs), log])
    return loop, log


def test_a_too_short_hand_built_one_cycle_is_reported_before_the_first_batch() -> None:
    # 4 batches x 2 epochs = 8 optimizer steps; the scheduler has 5: torch would raise
    # "Tried to step 6 times" at the sixth step.
    loop, log = one_cycle_loop(total_steps=5)
    weights = [p.detach().clone() for p in loop.model.parameters()]
    with pytest.raises(ConfigurationError) as info:
        loop.fit(2)
    message = str(info.value)
    assert "total_steps=5" in message and "8 times" in message
    assert "total_steps=total" in message and "lambda opt, total" in message
    assert log.batches == 0 and loop.state.step == 0
    assert all(torch.equal(p, w) for p, w in zip(loop.model.parameters(), weights))


def test_a_hand_built_one_cycle_of_exactly_the_right_length_runs_to_its_end() -> None:
    loop, _ = one_cycle_loop(total_steps=8)
    assert loop.fit(2).step == 8  # torch allows total_steps steps, and no more


def test_the_length_check_counts_the_steps_already_taken_in_a_later_fit() -> None:
    loop, log = one_cycle_loop(total_steps=8)
    loop.fit(1)  # 4 steps taken, 4 left in the scheduler
    with pytest.raises(ConfigurationError, match=r"4 steps left after 4 taken.*8 times"):
        loop.fit(3)  # 12 - 4 = 8 more steps
    assert log.batches == 4 and loop.state.step == 4


def test_the_length_check_accounts_for_a_resumed_position() -> None:
    first, _ = one_cycle_loop(total_steps=8)
    first.fit(1)
    position = first.state_dict()
    # A fresh 4-step schedule for what is left after step 4: comparing it with the whole
    # run's 8 steps would be wrong; the fit only takes 8 - 4 = 4.
    loop, log = one_cycle_loop(total_steps=4)
    loop.load_state_dict(position)
    assert loop.fit(2).step == 8 and log.batches == 4


def test_an_epoch_interval_fixed_length_scheduler_is_checked_in_epochs() -> None:
    loop, log = one_cycle_loop(total_steps=2, interval="epoch")
    with pytest.raises(ConfigurationError, match=r"3 times \(epochs"):
        loop.fit(3)
    assert log.batches == 0
    loop, _ = one_cycle_loop(total_steps=2, interval="epoch")
    assert loop.fit(2).epoch == 1


# ------------------------------------------------- an epoch cut short by loop.stop()
class StopOnce(Callback):
    """Calls loop.stop() once, after batch 1 of epoch 1, and keeps the state at that epoch end."""

    def __init__(self, scheduler_callback: LRScheduler) -> None:
        self.scheduler_callback = scheduler_callback
        self.done = False
        self.saved: dict[str, object] | None = None

    def on_batch_end(self, loop: Loop) -> None:
        if not self.done and loop.state.epoch == 1 and loop.state.batch_idx == 1:
            self.done = True
            loop.stop("test")

    def on_epoch_end(self, loop: Loop) -> None:  # runs after LRScheduler: a checkpoint here
        if self.done and self.saved is None:
            self.saved = copy.deepcopy(loop.state_dict())


@pytest.mark.parametrize("how", ["fit_again", "resume"])
def test_an_epoch_cut_short_by_stop_does_not_step_an_epoch_scheduler(how: str) -> None:
    data, epochs = make_data(4), 3
    model = make_model()  # the hand loop: 3 whole epochs, one scheduler step after each
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(epochs):
        for inputs, labels in data:
            F.mse_loss(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()

    hook_model = make_model()
    hook_optimizer = torch.optim.SGD(hook_model.parameters(), lr=0.1)
    callback = LRScheduler(lr_scheduler.StepLR(hook_optimizer, step_size=1, gamma=0.5),
                           interval="epoch")
    stopper = StopOnce(callback)
    loop = Loop(hook_model, hook_optimizer, data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[callback, stopper])
    loop.fit(epochs)  # stopped in epoch 1 after batch 1: one whole epoch done
    assert loop.stop_requested and callback.scheduler.last_epoch == 1
    if how == "resume":  # a fresh process restoring what was saved at that on_epoch_end
        saved = stopper.saved
        assert saved is not None and saved["loop"]["ended"] is not None
        hook_model = make_model()
        hook_optimizer = torch.optim.SGD(hook_model.parameters(), lr=0.1)
        callback = LRScheduler(lr_scheduler.StepLR(hook_optimizer, step_size=1, gamma=0.5),
                               interval="epoch")
        loop = Loop(hook_model, hook_optimizer, data, loss_fn=F.mse_loss, device="cpu",
                    callbacks=[callback])
        loop.load_state_dict(saved)
        loop.fit(epochs)  # the run ended by a stop stays ended with the same epochs
        assert loop.state.step == 6 and callback.scheduler.last_epoch == 1
        loop.load_state_dict(saved)
        loop.fit(epochs + 1, max_steps=4 * epochs)  # asking for more continues it
    else:
        loop.fit(epochs)
    assert callback.scheduler.last_epoch == epochs == scheduler.last_epoch
    assert hook_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** epochs)
    assert_same_weights(hook_model, model)


def test_an_epoch_cut_short_by_stop_does_not_step_a_plateau_without_validation() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = LRScheduler(lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", patience=0),
                           monitor="train_loss")
    loop = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                callbacks=[callback, StopOnce(callback)])
    loop.fit(3)
    assert callback.scheduler.last_epoch == 1  # epoch 0 only; epoch 1 was cut short
    loop.fit(3)
    assert callback.scheduler.last_epoch == 3  # one step per whole epoch, 3 epochs


def _plateau_run(capsys: pytest.CaptureFixture[str], scores: list[float],
                 **options: bool) -> tuple[list[str], list[float]]:
    """A plateau schedule on a scripted ``val_score``; the printed lines and the hand rates."""
    from builders import ScriptedMetric

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    callback = LRScheduler(lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                          patience=1),
                           monitor="val_score", **options)
    loop = Loop(model, optimizer, make_data(2), val_data=make_data(1, seed=8), loss_fn=F.mse_loss,
                device="cpu", sanity_val_batches=0,
                callbacks=[ScriptedMetric(scores, "val_score"), callback])
    capsys.readouterr()
    loop.fit(len(scores))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("LRSch")]
    # The hand rule: lowered after patience + 1 = 2 validations without improvement.
    rate, best, bad, rates = 0.2, math.inf, 0, []
    for score in scores:
        best, bad = (score, 0) if score < best else (best, bad + 1)
        if bad > 1:
            rate, bad = rate * 0.5, 0
        rates.append(rate)
    return lines, rates


def test_reduce_on_plateau_says_each_lowering_once(capsys: pytest.CaptureFixture[str]) -> None:
    scores = [1.0, 0.9, 0.95, 0.97, 0.8, 0.85, 0.9, 0.92]
    lines, rates = _plateau_run(capsys, scores)
    lowered = [(epoch, before, after) for epoch, (before, after)
               in enumerate(zip([0.2] + rates, rates), start=1) if after < before]
    assert len(lowered) == 2  # the scripted scores make the rule fire twice
    assert lines == [f"LRScheduler: val_score stopped improving; ReduceLROnPlateau lowered the "
                     f"learning rate from {before:.3g} to {after:.3g} (epoch {epoch}/8, "
                     f"step {2 * epoch})." for epoch, before, after in lowered]


def test_reduce_on_plateau_verbose_false_and_other_ranks_say_nothing(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    scores = [1.0, 1.1, 1.2, 1.3]
    lines, rates = _plateau_run(capsys, scores, verbose=False)
    assert lines == [] and rates[-1] < 0.2  # it lowered the rate, quietly
    from hookloop import distributed

    monkeypatch.setattr(distributed, "is_main", lambda: False)
    assert _plateau_run(capsys, scores)[0] == []


@pytest.mark.parametrize("plateau_first", [False, True])
def test_a_plateau_schedule_on_an_optimizer_another_schedule_drives_is_refused(
        plateau_first: bool) -> None:
    """Issue 25, item 13: warmup-cosine plus ReduceLROnPlateau on one optimizer was
    accepted, and the cosine undid the plateau's cuts. Refused before the first batch,
    whichever comes first, naming both and the fix."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cosine = LRScheduler(functools.partial(warmup_cosine, warmup_steps=2))
    plateau = LRScheduler(lr_scheduler.ReduceLROnPlateau(optimizer), monitor="val_loss",
                          name="plateau")
    log = LRLog()
    data = make_data(4)
    loop = Loop(model, optimizer, data, val_data=data[:1], loss_fn=F.mse_loss, device="cpu",
                callbacks=[log, plateau, cosine] if plateau_first else [log, cosine, plateau])
    with pytest.raises(CallbackOrderError, match=r"LRScheduler\(ReduceLROnPlateau.*"
                                                 r"LRScheduler\(WarmupCosine\) \(position \d\).*same optimizer.*"
                                                 r"remove one of the two"):
        loop.fit(1)
    assert log.batches == 0


def test_two_fixed_schedules_on_one_optimizer_are_still_accepted() -> None:
    """Only a plateau schedule must be alone: chained formula schedules stay as they were."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = LRScheduler(lambda opt, total: lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    second = LRScheduler(lambda opt, total: lr_scheduler.MultiplicativeLR(opt, lambda s: 0.5),
                         name="second")
    loop = Loop(model, optimizer, make_data(2), loss_fn=F.mse_loss, device="cpu",
                callbacks=[first, second])
    loop.fit(1)
    by_hand = torch.optim.SGD(make_model().parameters(), lr=0.1)  # the same two, stepped in order
    schedules = [lr_scheduler.LambdaLR(by_hand, lambda step: 1.0),
                 lr_scheduler.MultiplicativeLR(by_hand, lambda s: 0.5)]
    for _ in range(2):
        by_hand.step()
        for schedule in schedules:
            schedule.step()
    assert optimizer.param_groups[0]["lr"] == by_hand.param_groups[0]["lr"]


class CountStepped:
    """A scheduler with timm's stepping protocol (timm is not a dependency): the learning
    rate is a function of the epoch (``t_in_epochs=True``) or of the update count, set by
    ``step(epoch, metric=None)`` or ``step_update(num_updates, metric=None)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, t_in_epochs: bool,
                 warmup: int = 3, decay: float = 0.8) -> None:
        self.optimizer, self.t_in_epochs = optimizer, t_in_epochs
        self.warmup, self.decay = warmup, decay
        self.base = [group["lr"] for group in optimizer.param_groups]
        self.metrics: list[float | None] = []
        self._set(0)

    def _set(self, t: int) -> None:
        factor = (t + 1) / (self.warmup + 1) if t < self.warmup else self.decay ** (t - self.warmup)
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * factor

    def step(self, epoch: int, metric: float | None = None) -> None:
        self.metrics.append(metric)
        if self.t_in_epochs:
            self._set(epoch)

    def step_update(self, num_updates: int, metric: float | None = None) -> None:
        if not self.t_in_epochs:
            self._set(num_updates)

    def state_dict(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def timm_style_hand_loop(data: list, epochs: int, k: int, t_in_epochs: bool,
                         val: list | None = None) -> tuple[nn.Module, list[float], list]:
    """timm's train.py: step_update(num_updates) after every update, step(epoch + 1,
    metric) after every epoch."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = CountStepped(optimizer, t_in_epochs=t_in_epochs)
    num_updates, lrs = 0, []
    for epoch in range(epochs):
        for batch_idx, (inputs, labels) in enumerate(data):
            (F.mse_loss(model(inputs), labels) / k).backward()
            if (batch_idx + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad()
                num_updates += 1
                scheduler.step_update(num_updates=num_updates)
        metric = None
        if val is not None:
            with torch.no_grad():
                metric = sum(F.mse_loss(model(x), y) * len(x) for x, y in val).item() / sum(
                    len(x) for x, _ in val)
        scheduler.step(epoch + 1, metric)
        lrs.append(optimizer.param_groups[0]["lr"])
    return model, lrs, scheduler.metrics


@pytest.mark.parametrize("t_in_epochs", [False, True], ids=["updates", "epochs"])
def test_a_scheduler_with_timms_protocol_is_stepped_as_timm_steps_it(t_in_epochs: bool) -> None:
    data, epochs, k = make_data(6), 3, 2
    hand, hand_lrs, _ = timm_style_hand_loop(data, epochs, k, t_in_epochs)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = LRLog()
    callback = LRScheduler(CountStepped(optimizer, t_in_epochs=t_in_epochs))
    Loop(model, optimizer, data, loss_fn=F.mse_loss, device="cpu",
         callbacks=[GradAccumulation(k), callback, log]).fit(epochs)
    assert callback.steps_by_count
    assert log.lrs == hand_lrs and len(set(hand_lrs)) == epochs  # the rate moved each epoch
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p, q)


def test_a_timm_protocol_factory_with_a_monitor_gets_the_metric_and_resumes(tmp_path) -> None:  # noqa: ANN001
    data, val, epochs = make_data(4), make_data(2, seed=8), 4
    hand, hand_lrs, hand_metrics = timm_style_hand_loop(data, epochs, 1, False, val=val)

    def run(epochs_now: int, resume: bool) -> tuple[nn.Module, LRScheduler]:
        from hookloop.callbacks import Checkpoint
        model = make_model()
        callback = LRScheduler(lambda opt, total: CountStepped(opt, t_in_epochs=False),
                               monitor="val_loss")
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=val,
             loss_fn=F.mse_loss, device="cpu", sanity_val_batches=0,
             callbacks=[callback, Checkpoint(tmp_path, resume=resume)]).fit(epochs_now)
        return model, callback

    run(2, resume=False)  # a launch that ends after two epochs, then the relaunch
    model, callback = run(epochs, resume=True)
    # The relaunch's own step(epoch) at its start passes no metric; the epoch ends all do.
    metrics = callback.scheduler.metrics
    assert [m for m in metrics if m is not None] == pytest.approx(hand_metrics)
    assert metrics.count(None) == 1
    assert model.state_dict().keys() == hand.state_dict().keys()
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p, q)


class BareCountStepped(CountStepped):
    """timm's protocol without state_dict/load_state_dict (state is the caller's problem)."""

    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


def test_a_timm_protocol_scheduler_without_state_methods_is_driven_too() -> None:
    data, epochs = make_data(4), 2
    hand, hand_lrs, _ = timm_style_hand_loop(data, epochs, 1, False)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = LRLog()
    callback = LRScheduler(BareCountStepped(optimizer, t_in_epochs=False))
    loop = Loop(model, optimizer, data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[callback, log])
    loop.fit(epochs)
    assert log.lrs == hand_lrs and callback.state_dict() == {}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), hand.parameters()))


# -------------------------------- a schedule that goes below 0 (issue 33, item 14)
class Rates(Callback):
    """The learning rate each optimizer step used (read in before_step)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def before_step(self, loop: Loop) -> None:
        self.rates.append(float(loop.optimizer.param_groups[0]["lr"]))


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_schedule_that_makes_the_rate_negative_is_refused_naming_the_step(interval: str
                                                                           ) -> None:
    """A linear decay built for 4 steps (or epochs) but run for 8: its 5th value is
    negative, and the steps after it trained up the gradient, silently."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = lr_scheduler.LambdaLR(optimizer, lambda count: 1 - count / 4)
    rates = Rates()
    loop = Loop(model, optimizer, make_data(4 if interval == "step" else 1),
                loss_fn=F.mse_loss, device="cpu",
                callbacks=[rates, LRScheduler(schedule, interval=interval)])
    where = r"after optimizer step 5" if interval == "step" else r"at the end of epoch 5"
    with pytest.raises(ConfigurationError, match=r"LRScheduler\(LambdaLR\): the LambdaLR set "
                                                 r"param group 0's learning rate to -0\.025 "
                                                 + where + r".*factory"):
        loop.fit(8 if interval == "epoch" else 2)
    assert rates.rates == pytest.approx([0.1, 0.075, 0.05, 0.025, 0.0])  # never below 0


def test_a_tensor_rate_on_the_cpu_is_checked_at_the_step_too() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    schedule = lr_scheduler.LambdaLR(optimizer, lambda count: 1 - count / 2)
    loop = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                callbacks=[LRScheduler(schedule)])
    with pytest.raises(ConfigurationError, match=r"learning rate to -0\.05.* after optimizer "
                                                 r"step 3"):
        loop.fit(1)


def test_a_factory_whose_rate_is_negative_from_the_start_is_refused_at_fit_start() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                callbacks=[LRScheduler(lambda opt, total: lr_scheduler.LambdaLR(
                    opt, lambda count: count - 1))])
    with pytest.raises(ConfigurationError, match=r"learning rate to -0\.1 at fit start"):
        loop.fit(1)


def test_a_positive_linear_decay_to_zero_runs_its_hand_computed_rates() -> None:
    """The check changes nothing for a schedule that stays >= 0, to its end at 0."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rates = Rates()
    loop = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                callbacks=[rates, LRScheduler(lambda opt, total: lr_scheduler.LambdaLR(
                    opt, lambda count: 1 - count / total))])
    loop.fit(2)
    assert rates.rates == pytest.approx([0.1 * (1 - step / 8) for step in range(8)], abs=1e-12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_the_rate_set_after_the_last_step_is_refused_only_when_a_later_fit_would_use_it(
        ) -> None:
    """``1 - (count + 1) / 8`` over an 8-step fit trains at 7/8 ... 0 and sets -1/8 after
    the last step, which no step of that fit uses (found in review: it was refused, before
    the last epoch's end could save). A longer fit that would train at it is refused at
    its start."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = lr_scheduler.LambdaLR(optimizer, lambda count: 1 - (count + 1) / 8)
    rates = Rates()
    loop = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                callbacks=[rates, LRScheduler(schedule)])
    loop.fit(2)
    assert loop.state.step == 8
    assert rates.rates == pytest.approx([0.1 * (1 - (step + 1) / 8) for step in range(8)])
    with pytest.raises(ConfigurationError, match=r"learning rate -0\.0125 at fit start"):
        loop.fit(3)


@pytest.mark.parametrize("rate", [math.inf, math.nan])
def test_a_schedule_that_makes_the_rate_non_finite_is_refused_at_that_step(rate: float) -> None:
    """The usual rates are checked inline after a step (finite Python floats >= 0); an
    infinite or NaN one still gets the refusal naming the step, before any step uses it."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = lr_scheduler.LambdaLR(optimizer, lambda count: 1.0 if count < 2 else rate)
    rates = Rates()
    loop = Loop(model, optimizer, make_data(4), loss_fn=F.mse_loss, device="cpu",
                callbacks=[rates, LRScheduler(schedule)])
    with pytest.raises(ConfigurationError, match=r"learning rate to (inf|nan) after optimizer "
                                                 r"step 2"):
        loop.fit(1)
    assert rates.rates == [0.1, 0.1]
