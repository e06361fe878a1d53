"""EMA warmup and start_step against a hand computation of the shadow, step by step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import EMA

from builders import WeightRecorder, regression_batches, sgd
from builders import make_loop as build_loop


def make_loop(ema: EMA, batches: int = 6, recorder: WeightRecorder | None = None) -> Loop:
    callbacks = ([recorder] if recorder else []) + [ema]
    return build_loop(callbacks, model=lambda: nn.Linear(3, 2),
                      train=regression_batches(batches, outputs=2, seed=1), optimizer=sgd(0.3))


def hand_shadow(initial: dict[str, torch.Tensor], after: dict[int, dict[str, torch.Tensor]],
                decay: float, *, warmup: bool, start_step: int = 0,
                every: int = 1) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The average written out: returns the shadow and the decays used, in order."""
    shadow = {name: value.clone() for name, value in initial.items()}
    decays, t = [], 0
    for step in sorted(after):
        if step <= start_step:
            shadow = {name: value.clone() for name, value in after[step].items()}
            continue
        if step % every:
            continue
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        decays.append(d)
        shadow = {name: d * shadow[name] + (1 - d) * after[step][name] for name in shadow}
        t += 1
    return shadow, decays


def test_decay_at_each_step_is_the_documented_formula() -> None:
    ema = EMA(0.95)
    expected = [0.1, 2 / 11, 3 / 12, 4 / 13, 5 / 14]
    seen = []
    for t in range(5):
        ema.updates = t
        seen.append(ema.current_decay())
    assert seen == pytest.approx(expected)
    ema.updates = 1000
    assert ema.current_decay() == 0.95  # capped at decay
    assert EMA(0.95, warmup=False).current_decay() == 0.95
    # The example: 0.999 reaches its decay only after (10 d - 1) / (1 - d) updates.
    ema = EMA(0.999)
    ema.updates = 8989
    assert ema.current_decay() < 0.999
    ema.updates = 8990
    assert ema.current_decay() == pytest.approx(0.999)


@pytest.mark.parametrize("warmup", [True, False])
@pytest.mark.parametrize("every", [1, 2])
def test_shadow_matches_the_hand_computation(warmup: bool, every: int) -> None:
    recorder = WeightRecorder(torch.float64)  # in double; before EMA at after_step
    ema = EMA(0.9, warmup=warmup, every_n_steps=every)
    loop = make_loop(ema, recorder=recorder)
    initial = {name: value.detach().clone().double() for name, value in loop.model.state_dict().items()}
    loop.fit(2)
    expected, decays = hand_shadow(initial, recorder.after, 0.9, warmup=warmup, every=every)
    assert len(recorder.after) == 12 and ema.updates == len(decays) == 12 // every
    if warmup:
        assert decays[:3] == pytest.approx([0.1, 2 / 11, 3 / 12])
    for name, value in ema.averaged_state_dict().items():
        assert torch.allclose(value.double(), expected[name], atol=1e-6), name


def test_warmup_keeps_early_averages_close_to_the_trained_weights() -> None:
    """The issue's complaint: after 100 steps at 0.999 the plain average is ~90% theta_0."""
    assert 0.999 ** 100 == pytest.approx(0.905, abs=1e-3)
    recorder = WeightRecorder(torch.float64)  # in double; before EMA at after_step
    ema = EMA(0.999)
    loop = make_loop(ema, recorder=recorder)
    initial = {name: value.detach().clone().double() for name, value in loop.model.state_dict().items()}
    loop.fit(2)
    # Weight of theta_0 in the average after 12 warmup updates: prod of the decays.
    weight_of_initial = 1.0
    for t in range(12):
        weight_of_initial *= (1 + t) / (10 + t)
    assert weight_of_initial < 1e-5  # vs 0.999 ** 12 = 0.988 without the warmup
    expected, _ = hand_shadow(initial, recorder.after, 0.999, warmup=True)
    for name, value in ema.averaged_state_dict().items():
        assert torch.allclose(value.double(), expected[name], atol=1e-6)


@pytest.mark.parametrize("warmup", [True, False])
def test_start_step_restarts_from_the_weights_at_that_step(warmup: bool) -> None:
    recorder = WeightRecorder(torch.float64)  # in double; before EMA at after_step
    ema = EMA(0.8, warmup=warmup, start_step=4)
    loop = make_loop(ema, recorder=recorder)
    initial = {name: value.detach().clone().double() for name, value in loop.model.state_dict().items()}
    loop.fit(1, max_steps=4)
    assert ema.updates == 0  # no averaging up to start_step: the shadow is theta_4
    for name, value in ema.averaged_state_dict().items():
        assert torch.equal(value.double(), recorder.after[4][name]), name
    loop.fit(2)
    expected, decays = hand_shadow(initial, recorder.after, 0.8, warmup=warmup, start_step=4)
    assert ema.updates == len(decays) == 8
    assert decays[0] == (0.1 if warmup else 0.8)  # the count starts at start_step
    for name, value in ema.averaged_state_dict().items():
        assert torch.allclose(value.double(), expected[name], atol=1e-6), name


def test_resume_keeps_the_update_count_and_the_shadow() -> None:
    whole_ema = EMA(0.9, start_step=2)
    whole = make_loop(whole_ema)
    whole.fit(3)
    first_ema = EMA(0.9, start_step=2)
    first = make_loop(first_ema)
    first.fit(1, max_steps=5)
    saved = first.state_dict()
    assert saved["callbacks"]["EMA"]["updates"] == 3
    resumed_ema = EMA(0.9, start_step=2)
    resumed = make_loop(resumed_ema)
    resumed.load_state_dict(saved)
    resumed.fit(3)
    assert resumed_ema.updates == whole_ema.updates == 16
    for name, value in whole_ema.averaged_state_dict().items():
        assert torch.equal(resumed_ema.averaged_state_dict()[name], value), name


@pytest.mark.parametrize("kwargs", [dict(start_step=-1), dict(start_step=1.5),
                                    dict(start_step=True), dict(warmup=1)])
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        EMA(**kwargs)  # type: ignore[arg-type]


def test_update_makes_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decay comes from a Python int: no .item()/.tolist() inside the update."""
    ema = EMA(0.99, start_step=1)
    loop = make_loop(ema, batches=2)
    loop.fit(1)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in EMA.update")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    before = ema.updates
    ema.update()
    ema._follow()
    assert ema.updates == before + 1
