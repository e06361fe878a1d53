"""AMP against hand-written autocast/GradScaler loops (the seeds' loops), on CPU, and the scale
after many overflows: one warning, and a floor it never goes below."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop
from hookloop.callbacks import AMP, EMA, GradAccumulation, GradClip, LRScheduler
from hookloop.callbacks import amp as amp_module
from hookloop.schedules import warmup_cosine

from builders import make_loop, regression_batches, sgd, two_layers


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return two_layers(6, 16, 2, nn.Tanh())


def make_data(batches: int, seed: int = 1, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return regression_batches(batches, size=size, features=6, outputs=2, seed=seed)


class Recorder(Callback):
    """Records what the loop did: batches started, steps taken, scales, weights."""

    def __init__(self, amp: AMP | None = None) -> None:
        self.amp = amp
        self.batches = 0
        self.steps: list[tuple[int, int]] = []
        self.scales: list[float] = []
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

    def on_batch_start(self, loop: Loop) -> None:
        self.batches += 1
        self.before.append(torch.cat([p.detach().flatten().clone() for p in loop.model.parameters()]))

    def after_step(self, loop: Loop) -> None:
        self.steps.append((loop.state.epoch, loop.state.batch_idx))

    def on_batch_end(self, loop: Loop) -> None:
        self.after.append(torch.cat([p.detach().flatten().clone() for p in loop.model.parameters()]))
        if self.amp is not None and self.amp.scaler is not None:
            self.scales.append(self.amp.scaler.get_scale())


def hand_cosine(base: float, total: int, warmup: int, min_lr: float):  # noqa: ANN201
    """The seeds' warmup (base * t / W) then cosine to min_lr, as a LambdaLR factor."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return (min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / base
    return factor


def test_float16_scaler_clip_accumulation_cosine_ema_match_hand_loop() -> None:
    epochs, batches, accumulation, max_norm, decay = 2, 16, 4, 1.0, 0.9
    base_lr, warmup, min_lr = 0.05, 2, 1e-3
    data, val = make_data(batches), make_data(3, seed=7)

    # The hand-written loop: seed 004's "clip + AMP + accumulation", a per-step scheduler
    # after the step (seed 000) and seed 004's EMA class, validated with the EMA weights.
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9)
    total = epochs * math.ceil(batches / accumulation)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, hand_cosine(base_lr, total, warmup, min_lr))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    shadow = {name: p.detach().clone() for name, p in model.named_parameters()}
    norms, lrs = [], []
    for _ in range(epochs):
        model.train()
        for batch_idx, (inputs, labels) in enumerate(data):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(inputs), labels) / accumulation
            scaler.scale(loss).backward()
            if (batch_idx + 1) % accumulation == 0:
                scaler.unscale_(optimizer)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                scheduler.step()
                lrs.append(optimizer.param_groups[0]["lr"])
                for name, p in model.named_parameters():
                    shadow[name] = decay * shadow[name] + (1.0 - decay) * p.detach()
    backup = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shadow[name])
        model.eval()
        with torch.autocast("cpu", dtype=torch.float16):
            val_losses = [F.mse_loss(model(x), y).double() * len(x) for x, y in val]
        hand_val_loss = (sum(val_losses) / sum(len(x) for x, _ in val)).item()
        for name, p in model.named_parameters():
            p.copy_(backup[name])

    # The same with hookloop.
    hook_model = make_model()
    hook_optimizer = torch.optim.SGD(hook_model.parameters(), lr=base_lr, momentum=0.9)
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    ema = EMA(decay, warmup=False)
    lr_log: list[float] = []

    class LogLR(Callback):
        def after_step(self, loop: Loop) -> None:
            lr_log.append(loop.optimizer.param_groups[0]["lr"])

    loop = Loop(hook_model, hook_optimizer, data, val_data=val, loss_fn=F.mse_loss, device="cpu",
                callbacks=[amp, GradAccumulation(accumulation), GradClip(max_norm),
                           LRScheduler(functools.partial(warmup_cosine, warmup_steps=warmup,
                                                         min_lr=min_lr)),
                           ema, LogLR()])
    state = loop.fit(epochs)

    assert state.step == total == 8
    assert lr_log == pytest.approx(lrs, abs=1e-12)
    for (name, p), hand in zip(hook_model.named_parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6), name
    averaged = ema.averaged_state_dict()
    for name in shadow:
        assert torch.allclose(averaged[name], shadow[name], atol=1e-6), name
    assert torch.allclose(state.grad_norm, norms[-1], atol=1e-6)
    assert state.metrics["val_loss"] == pytest.approx(hand_val_loss, rel=1e-5, abs=1e-7)
    assert amp.scaler.get_scale() == scaler.get_scale()


def test_bfloat16_without_scaler_matches_hand_loop() -> None:
    data, val = make_data(5), make_data(2, seed=3)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model.train()
        for inputs, labels in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hand_val = sum(F.mse_loss(model(x), y).double() * len(x) for x, y in val) / 16

    hook_model = make_model()
    amp = AMP()
    seen_dtypes: list[torch.dtype] = []

    class OutputDtype(Callback):
        def on_validation_batch_end(self, loop: Loop) -> None:
            seen_dtypes.append(loop.state.outputs.dtype)

    loop = Loop(hook_model, torch.optim.AdamW(hook_model.parameters(), lr=1e-2), data,
                val_data=val, loss_fn=F.mse_loss, device="cpu", callbacks=[amp, OutputDtype()])
    state = loop.fit(2)
    assert amp.scaler is None
    assert seen_dtypes and set(seen_dtypes) == {torch.bfloat16}  # validation under autocast
    for p, hand in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, hand, atol=1e-6)
    assert state.metrics["val_loss"] == pytest.approx(hand_val.item(), rel=1e-6)


def test_backward_runs_outside_autocast() -> None:
    inside: list[bool] = []

    class Probe(Callback):
        def after_forward(self, loop: Loop) -> None:
            inside.append(torch.is_autocast_enabled("cpu"))

        def after_backward(self, loop: Loop) -> None:
            inside.append(torch.is_autocast_enabled("cpu"))

    def forward(loop: Loop, batch):  # noqa: ANN001, ANN202
        inputs, targets = batch
        outputs = loop.model(inputs)
        inside.append(torch.is_autocast_enabled("cpu"))
        return outputs, F.mse_loss(outputs, targets)

    model = make_model()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(1), forward=forward,
         device="cpu", callbacks=[AMP(), Probe()]).fit(1)
    assert inside == [True, False, False]


@pytest.mark.parametrize("optimizer_kind", ["sgd", "fused_adam"])
def test_inf_gradient_skips_one_step(optimizer_kind: str) -> None:
    class InjectInf(Callback):
        def after_backward(self, loop: Loop) -> None:
            if loop.state.batch_idx == 2:
                next(loop.model.parameters()).grad[0, 0] = float("inf")

    model = make_model()
    if optimizer_kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        assert optimizer._step_supports_amp_scaling
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ema = EMA(0.5)
    recorder = Recorder(amp)
    loop = Loop(model, optimizer, make_data(6), loss_fn=F.mse_loss, device="cpu",
                callbacks=[amp, InjectInf(), LRScheduler(scheduler), ema, recorder])
    shadow_before: list[torch.Tensor] = []

    class ShadowProbe(Callback):
        def on_batch_end(self, loop: Loop) -> None:
            shadow_before.append(torch.cat([t.flatten() for t in ema.averaged_state_dict().values()]))

    loop.callbacks.append(ShadowProbe())
    state = loop.fit(1)

    assert recorder.steps == [(0, 0), (0, 1), (0, 3), (0, 4), (0, 5)]  # no after_step at batch 2
    assert state.step == 5
    assert scheduler.last_epoch == 5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 5)
    assert ema.updates == 5 and amp.skipped_steps == 1
    assert torch.equal(recorder.before[2], recorder.after[2])  # weights untouched
    assert torch.equal(shadow_before[1], shadow_before[2])  # EMA did not advance
    assert recorder.scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
    if optimizer_kind == "fused_adam":
        assert optimizer._step_supports_amp_scaling is True  # restored after each step
        assert optimizer.state[next(model.parameters())]["step"].item() == 5


@pytest.mark.parametrize("canceller_first", [False, True])
def test_cancelled_step_after_unscale_still_updates_the_scaler(canceller_first: bool) -> None:
    class CancelAt1(Callback):
        def before_step(self, loop: Loop) -> None:
            if loop.state.batch_idx == 1:
                loop.cancel_step()

    model = make_model()
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    recorder = Recorder(amp)
    stack = [CancelAt1(), amp] if canceller_first else [amp, CancelAt1()]
    state = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(4),
                 loss_fn=F.mse_loss, device="cpu", callbacks=[*stack, recorder]).fit(1)
    assert state.step == 3
    assert [batch for _, batch in recorder.steps] == [0, 2, 3]
    assert amp.skipped_steps == 0
    assert recorder.scales == [1024.0] * 4


def test_half_precision_weights_with_a_scaler_are_rejected_before_training() -> None:
    model = make_model().half()
    recorder = Recorder()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2),
                loss_fn=F.mse_loss, device="cpu", callbacks=[AMP(torch.float16), recorder])
    with pytest.raises(ConfigurationError, match=r"float32.*model\.float\(\)"):
        loop.fit(1)
    assert recorder.batches == 0


def test_wrong_orders_and_duplicates_raise_before_the_first_batch() -> None:
    for stack in ([GradClip(1.0), AMP(torch.float16)], [AMP(), AMP(torch.float16)]):
        recorder = Recorder()
        model = make_model()
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(2),
                    loss_fn=F.mse_loss, device="cpu", callbacks=[*stack, recorder])
        with pytest.raises(CallbackOrderError, match="AMP"):
            loop.fit(1)
        assert recorder.batches == 0


def test_bad_arguments() -> None:
    with pytest.raises(ConfigurationError, match="dtype"):
        AMP(torch.float32)
    with pytest.raises(ConfigurationError, match="scaler"):
        AMP(torch.float16, scaler="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="init_scal"):
        AMP(torch.float16, scaler={"init_scal": 2.0})
    assert AMP("fp16").dtype == torch.float16 and AMP("bf16").dtype == torch.bfloat16
    assert AMP(torch.bfloat16, scaler=True)._scaler_kwargs == {}
    assert AMP(torch.float16, scaler=False)._scaler_kwargs is None


def test_scaler_arguments_pass_through() -> None:
    model = make_model()
    amp = AMP(torch.float16, scaler={"init_scale": 256.0, "growth_interval": 2})
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), make_data(4), loss_fn=F.mse_loss,
         device="cpu", callbacks=[amp]).fit(1)
    assert amp.scaler.get_growth_interval() == 2
    assert amp.scaler.get_scale() == 1024.0  # grew twice in 4 clean steps


def test_state_round_trip(tmp_path) -> None:  # noqa: ANN001
    class InjectInf(Callback):
        def after_backward(self, loop: Loop) -> None:
            if loop.state.batch_idx == 0:
                next(loop.model.parameters()).grad[0, 0] = float("nan")

    model = make_model()
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0, "growth_interval": 3})
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), make_data(3), loss_fn=F.mse_loss,
         device="cpu", callbacks=[amp, InjectInf()]).fit(1)
    torch.save(amp.state_dict(), tmp_path / "amp.pt")
    state = torch.load(tmp_path / "amp.pt", weights_only=True)
    assert state["scaler"]["scale"] == 512.0 and state["skipped_steps"] == 1

    # The loop loads callback states after setup, once the scaler exists.
    fresh = AMP(torch.float16)
    other = make_model()
    Loop(other, torch.optim.SGD(other.parameters(), lr=0.01), make_data(1), loss_fn=F.mse_loss,
         device="cpu", callbacks=[fresh]).fit(0)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # Loaded into a live scaler.
    live = AMP(torch.float16)
    Loop(other, torch.optim.SGD(other.parameters(), lr=0.01), make_data(1), loss_fn=F.mse_loss,
         device="cpu", callbacks=[live]).fit(0)
    live.load_state_dict(state)
    assert live.state_dict() == state
    assert AMP().state_dict() == {"scaler": {}, "skipped_steps": 0}


def test_a_later_fit_continues_the_scaler_and_another_loop_is_refused() -> None:
    amp = AMP(torch.float16, scaler={"init_scale": 256.0, "growth_interval": 1})
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), make_data(2),
                loss_fn=F.mse_loss, device="cpu", callbacks=[amp])
    loop.fit(1)
    assert amp.scaler.get_scale() == 1024.0  # 256 doubled twice
    loop.fit(2)
    assert amp.scaler.get_scale() == 4096.0  # and twice more: the same scaler goes on
    other = make_model()
    with pytest.raises(ConfigurationError, match="already ran in another Loop"):
        Loop(other, torch.optim.SGD(other.parameters(), lr=0.01), make_data(2),
             loss_fn=F.mse_loss, device="cpu", callbacks=[amp]).fit(1)


def test_an_exception_inside_optimizer_step_still_pairs_the_scaler_update() -> None:
    class InterruptedOnce(torch.optim.SGD):
        armed = False

        def step(self, closure=None):  # noqa: ANN001, ANN202
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt  # Ctrl-C while the optimizer steps
            return super().step(closure)

    data = make_data(4)
    model = make_model()  # the hand loop: 4 float16 steps through a GradScaler
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for inputs, targets in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    class ArmAt1(Callback):
        done = False

        def before_step(self, loop: Loop) -> None:
            if not self.done and loop.state.batch_idx == 1:
                self.done = loop.optimizer.armed = True

    hook_model = make_model()
    hook_optimizer = InterruptedOnce(hook_model.parameters(), lr=0.1)
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop = Loop(hook_model, hook_optimizer, data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[amp, ArmAt1()])
    with pytest.raises(KeyboardInterrupt):
        loop.fit(1)
    assert loop.state.step == 1
    state = loop.fit(1)  # resumes at batch 1, with a scaler that unscales anew
    assert state.step == 4 and amp.skipped_steps == 0
    assert amp.scaler.get_scale() == scaler.get_scale() == 1024.0
    for p, q in zip(hook_model.parameters(), model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


# -------------------------------------------------- the scale after many overflows


def _poisoned_loop(batches: int, bad: set[int], amp: AMP) -> tuple[Loop, nn.Module]:
    """A linear regression whose batches in ``bad`` hold an inf input: their steps overflow."""
    def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
        drawn = regression_batches(batches)  # the global generator, after the model
        for index in bad:
            drawn[index][0][0, 0] = float("inf")
        return drawn

    loop = make_loop([amp], train=data, optimizer=sgd(0.01))
    return loop, loop.model


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


class SkipNonFiniteBatches(Callback):
    """A "skip the bad batch" policy: cancels every step whose unscaled gradients are not
    finite (each cancelled step is still paired with a scaler.update())."""

    runs_after = {"AMP": "reads unscaled gradients"}

    def before_step(self, loop: Loop) -> None:
        grads = [p.grad for p in loop.optimizer.param_groups[0]["params"] if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            loop.cancel_step()


def test_amp_scale_never_reaches_zero_when_steps_are_cancelled() -> None:
    """The scale's floor holds for steps a callback cancels too, not only for those the
    scaler skipped."""
    data = regression_batches(210, seed=1)
    for inputs, _ in data[:200]:
        inputs[0, 0] = float("inf")
    amp = AMP(torch.float16, scaler={"init_scale": 1024.0})
    loop = make_loop([amp, SkipNonFiniteBatches()], train=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop.fit(1)
    # Oracle: AMP's documented floor (docs/when-things-go-wrong.md: "The scale is never
    # allowed below 2**-16"); and the 10 clean batches at the end must be stepped.
    assert amp.scaler.get_scale() >= amp_module.MIN_SCALE, amp.scaler.get_scale()
    assert loop.state.step == 10


def test_bfloat16_amp_calls_nothing_per_batch_but_its_autocast() -> None:
    # Without a GradScaler, AMP's loss, step and batch-end methods would only call
    # optimizer.step(): the fit's table leaves them out (issue 38), the loop steps the
    # optimizer itself, and the weights are those of the same autocast by hand.
    def run(callbacks: list[Callback]) -> Loop:
        torch.manual_seed(0)
        model = two_layers(3, 8, 1)
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), regression_batches(6),
                    loss_fn=F.mse_loss, callbacks=callbacks, device="cpu")
        loop.fit(2)
        return loop

    class Autocast(Callback):
        def forward_context(self, loop: Loop):
            return torch.autocast("cpu", dtype=torch.bfloat16)

    loop = run([AMP(torch.bfloat16)])
    table = loop._table
    assert table.step is None
    assert (table.scale_loss, table.before_step, table.on_batch_end) == ((), (), ())
    assert len(table.forward_context) == 1
    reference = run([Autocast()])
    assert all(torch.equal(a, b) for a, b in zip(loop.model.parameters(),
                                                 reference.model.parameters()))
