"""ModelSummary: torchinfo's count of a model whose parameters are counted by hand, and a run
that is bitwise the same with or without the summary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Loop
from hookloop.callbacks import ModelSummary

from builders import classification_batches, make_loop


def known_model() -> nn.Module:
    # 5*8+8 + 2*8 (BN weight, bias) + 8*3+3 = 48 + 16 + 27 = 91 parameters
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(8, 3))


def fit(callbacks, batches=None) -> Loop:
    loop = make_loop(callbacks, model=known_model,
                     train=batches or classification_batches(3, seed=1), loss_fn=F.cross_entropy)
    loop.fit(2)
    return loop


def test_total_parameters_of_a_known_model_from_the_first_batch(capsys) -> None:
    summary = ModelSummary(depth=2)
    fit([summary])
    assert summary.summary is not None
    assert summary.summary.total_params == 91 == sum(p.numel() for p in known_model().parameters())
    assert summary.summary.summary_list[0].output_size == [4, 3]  # the batch's shape went through
    assert "Total params: 91" in capsys.readouterr().out


def test_input_size_runs_at_fit_start() -> None:
    summary = ModelSummary(input_size=(2, 5), print_summary=False)
    fit([summary])
    assert summary.summary.total_params == 91


def test_the_run_is_unchanged_by_the_summary() -> None:
    with_summary = fit([ModelSummary(print_summary=False)])
    without = fit([])
    for a, b in zip(with_summary.model.state_dict().values(), without.model.state_dict().values()):
        assert torch.equal(a, b)  # BN statistics, weights (dropout RNG) all equal
    assert with_summary.model.training


def test_mapping_batches_are_passed_as_keyword_arguments() -> None:
    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(5, 3)

        def forward(self, features, labels):
            return {"loss": F.cross_entropy(self.linear(features), labels)}

    model = Keyed()
    batches = [{"features": torch.randn(4, 5), "labels": torch.randint(0, 3, (4,))}]
    summary = ModelSummary(print_summary=False)
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, callbacks=[summary],
         device="cpu").fit(1)
    assert summary.summary.total_params == 18


def test_failure_is_a_warning() -> None:
    summary = ModelSummary(input_size=(2, 7), print_summary=False)  # wrong width
    with pytest.warns(RuntimeWarning, match="torchinfo failed"):
        loop = fit([summary])
    assert loop.state.step == 6 and summary.summary is None
