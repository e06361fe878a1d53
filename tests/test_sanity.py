"""The sanity check before training: it finds a broken metric or target before the first
training batch, runs only the batches asked for, and changes nothing of the run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import EarlyStopping, Metrics

from builders import BatchCounter
from builders import dropout_loop as make_loop


def test_a_metric_of_the_wrong_shape_fails_before_the_first_training_batch() -> None:
    counter = BatchCounter()
    loop = make_loop([counter, Metrics(per_sample=lambda outputs, targets: outputs - targets)])
    with pytest.raises(ConfigurationError, match="shape"):
        loop.fit(3)
    assert counter.batches == 0 and loop.state.step == 0


def test_a_missing_target_fails_before_the_first_training_batch() -> None:
    counter = BatchCounter()
    model = nn.Linear(3, 2)
    data = [{"x": torch.randn(4, 3), "label": torch.randint(0, 2, (4,))}]

    def forward(loop: Loop, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = loop.model(batch["x"])
        return outputs, F.cross_entropy(outputs, batch["label"])

    accuracy = Metrics(acc=lambda outputs, targets: (outputs.argmax(-1) == targets).float().mean())
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data * 50, val_data=data,
                forward=forward, callbacks=[counter, accuracy], device="cpu")
    with pytest.raises(ConfigurationError, match="no targets"):
        loop.fit(1)
    assert counter.batches == 0


def test_sanity_check_off_finds_the_error_after_the_epoch() -> None:
    counter = BatchCounter()
    loop = make_loop([counter, Metrics(per_sample=lambda outputs, targets: outputs - targets)],
                     sanity_val_batches=0)
    with pytest.raises(ConfigurationError, match="shape"):
        loop.fit(3)
    assert counter.batches == 4


def test_sanity_check_changes_nothing() -> None:
    """Dropout and a shuffled loader: any random draw the check made would show here."""
    runs = []
    for batches in (2, 0):
        metrics = Metrics(mean=lambda outputs, targets: outputs.mean())
        loop = make_loop([metrics, EarlyStopping(patience=3)], sanity_val_batches=batches)
        loop.fit(3)
        runs.append((loop, torch.get_rng_state()))
    (checked, rng_checked), (plain, rng_plain) = runs
    for name, value in plain.model.state_dict().items():
        assert torch.equal(checked.model.state_dict()[name], value), name
    assert checked.state.history == plain.state.history
    assert checked.state.metrics == plain.state.metrics
    assert torch.equal(rng_checked, rng_plain)
    assert torch.equal(checked.train_data.generator.get_state(), plain.train_data.generator.get_state())


def test_sanity_check_runs_only_the_requested_batches() -> None:
    seen = []

    class Seen(Metrics):
        def on_validation_batch_end(self, loop: Loop) -> None:
            if loop.sanity_checking:
                seen.append(loop.state.batch_idx)
            super().on_validation_batch_end(loop)

    loop = make_loop([Seen(mean=lambda o, t: o.mean())], sanity_val_batches=1)
    loop.fit(1)
    assert seen == [0]


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_bad_sanity_val_batches(value: object) -> None:
    with pytest.raises(ConfigurationError, match="sanity_val_batches"):
        make_loop(sanity_val_batches=value)
