"""hookloop.schedules.warmup_cosine against its formula and torch's CosineAnnealingLR."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim import lr_scheduler

from hookloop import ConfigurationError
from hookloop.schedules import WarmupCosine, warmup_cosine


def optimizer_with(*lrs: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}
                            for lr in lrs])


def formula(step: int, base: float, total: int, warmup: int, min_lr: float) -> float:
    if step < warmup:
        return base * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def rates(scheduler: lr_scheduler.LRScheduler, steps: int) -> list[list[float]]:
    seen = [scheduler.get_last_lr()]
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        seen.append(scheduler.get_last_lr())
    return seen


def test_follows_the_formula_for_every_group() -> None:
    total, warmup, min_lr = 20, 5, 0.001
    scheduler = warmup_cosine(optimizer_with(0.1, 0.03), total, warmup, min_lr)
    for step, lrs in enumerate(rates(scheduler, total + 3)):
        for lr, base in zip(lrs, (0.1, 0.03)):
            assert lr == pytest.approx(formula(step, base, total, warmup, min_lr), abs=1e-12)
    assert scheduler.get_last_lr()[0] == pytest.approx(min_lr)  # stays at min_lr after T


def test_after_warmup_it_is_cosine_annealing() -> None:
    total, warmup, min_lr = 16, 4, 0.002
    ours = rates(warmup_cosine(optimizer_with(0.1), total, warmup, min_lr), total)
    torch_cosine = rates(lr_scheduler.CosineAnnealingLR(optimizer_with(0.1), T_max=total - warmup,
                                                        eta_min=min_lr), total - warmup)
    for mine, theirs in zip(ours[warmup:], torch_cosine):
        assert mine[0] == pytest.approx(theirs[0], abs=1e-9)
    assert [lr[0] for lr in ours[:warmup]] == pytest.approx([0.0, 0.025, 0.05, 0.075])  # base*t/W


def test_warmup_as_a_fraction_and_edge_cases() -> None:
    assert warmup_cosine(optimizer_with(0.1), 1000, 0.05).warmup_steps == 50
    no_warmup = warmup_cosine(optimizer_with(0.1), 10, 0)
    assert no_warmup.get_last_lr() == [0.1]
    only_warmup = rates(warmup_cosine(optimizer_with(0.1), 4, 4), 5)
    assert [lr[0] for lr in only_warmup] == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.0])


@pytest.mark.parametrize("warmup", [1.0, 0.0, -1, 11, "5", True])
def test_bad_warmup(warmup: object) -> None:
    with pytest.raises(ConfigurationError, match="warmup_steps"):
        warmup_cosine(optimizer_with(0.1), 10, warmup)  # type: ignore[arg-type]


def test_bad_total_and_min_lr() -> None:
    with pytest.raises(ConfigurationError, match="total_steps"):
        warmup_cosine(optimizer_with(0.1), 0, 0)
    with pytest.raises(ConfigurationError, match="min_lr"):
        warmup_cosine(optimizer_with(0.1), 10, 0, min_lr=-1.0)


def test_state_is_weights_only_safe_and_resumes(tmp_path) -> None:  # noqa: ANN001
    scheduler = warmup_cosine(optimizer_with(0.1), 10, 3, 0.01)
    rates(scheduler, 4)
    torch.save(scheduler.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    resumed = warmup_cosine(optimizer_with(0.1), 10, 3, 0.01)
    resumed.load_state_dict(state)
    assert isinstance(resumed, WarmupCosine)
    assert rates(resumed, 3) == rates(scheduler, 3)


def test_warmup_linear_rises_then_falls_in_straight_lines() -> None:
    from hookloop.schedules import WarmupLinear, warmup_linear

    total, warmup, min_lr = 10, 2, 0.01
    scheduler = warmup_linear(optimizer_with(0.1), total, warmup, min_lr)
    assert isinstance(scheduler, WarmupLinear) and not isinstance(scheduler, WarmupCosine)
    expected = [0.0, 0.05] + [min_lr + (0.1 - min_lr) * (1 - (t - 2) / 8) for t in range(2, 11)]
    seen = [lrs[0] for lrs in rates(scheduler, total + 2)]
    assert seen == pytest.approx(expected + [min_lr, min_lr])
    with pytest.raises(ConfigurationError, match="total_steps"):
        warmup_linear(optimizer_with(0.1), 0, 0)
