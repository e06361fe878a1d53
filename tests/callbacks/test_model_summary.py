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


def _table(width: int) -> list[str]:
    """The summary printed on a rich console of ``width`` columns, as lines."""
    import io

    from rich.console import Console

    screen = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(),
                          nn.Sequential(nn.Dropout(0.5), nn.Linear(8, 3)))
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), classification_batches(1, seed=1),
         loss_fn=F.cross_entropy, device="cpu", callbacks=[ModelSummary(console=screen)]).fit(1)
    return screen.file.getvalue().splitlines()


@pytest.mark.parametrize("width, names, cells", [(80, 31, 26), (120, 41, 26)])
def test_the_table_fits_the_console_and_its_rules_do_not_wrap(width: int, names: int,
                                                              cells: int) -> None:
    """At 80 columns torchinfo's 90-wide table is narrowed to 80 (names 30, cells 25); at 120
    it is torchinfo's own. Parameters by hand: 5*8+8, 2*8 (BN), 8*3+3."""
    lines = _table(width)
    rows = [("Layer (type:depth-idx)", "Output Shape", "Param #"),
            ("Sequential", "[4, 3]", "--"), ("├─Linear: 1-1", "[4, 8]", "48"),
            ("├─BatchNorm1d: 1-2", "[4, 8]", "16"), ("├─ReLU: 1-3", "[4, 8]", "--"),
            ("├─Sequential: 1-4", "[4, 3]", "--"), ("│    └─Dropout: 2-1", "[4, 8]", "--"),
            ("│    └─Linear: 2-2", "[4, 3]", "27")]
    rule = "=" * (names - 1 + 2 * (cells - 1))
    table = [f"{name:<{names}}{shape:<{cells}}{count}" for name, shape, count in rows]
    assert lines[:11] == [rule, table[0], rule, *table[1:], rule]
    assert lines[11:14] == ["Total params: 91", "Trainable params: 91", "Non-trainable params: 0"]
    assert all(len(line) <= width for line in lines) and lines.count(rule) == 5
