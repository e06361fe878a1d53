"""The missing-target error of Metrics names the batch's real keys and both ways to say where
the targets are (issue 19, item 6)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import Metrics


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=-1) == targets).float().mean()


class DictModel(torch.nn.Module):
    """A model called as model(**batch) that returns its logits and loss in a dict."""

    def __init__(self, inputs: str, targets: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.inputs, self.targets = inputs, targets

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.linear(batch[self.inputs])
        return {"logits": logits, "loss": F.cross_entropy(logits, batch[self.targets])}


def error_for(inputs: str, targets: str) -> str:
    torch.manual_seed(0)
    batches = [{inputs: torch.randn(8, 4), targets: torch.randint(0, 3, (8,))}]
    model = DictModel(inputs, targets)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, val_data=batches,
                device="cpu", callbacks=[Metrics(acc=accuracy)])
    with pytest.raises(ConfigurationError) as caught:
        loop.fit(1)
    return str(caught.value)


@pytest.mark.parametrize(("inputs", "targets"), [("image", "label"), ("pixels", "digit")])
def test_the_error_names_the_real_keys_and_both_options(inputs: str, targets: str) -> None:
    message = error_for(inputs, targets)
    assert f"the keys {inputs!r}, {targets!r}" in message
    assert f"Loop(..., targets={targets!r})" in message  # the loop's rule, for everything
    assert f"Metrics(..., targets=lambda batch: batch[{targets!r}])" in message
    assert "Metrics(..., outputs=lambda outputs: outputs['logits'])" in message
    if targets != "label":  # not a fixed example: the key this batch has
        assert "batch['label']" not in message


def test_the_suggested_options_work() -> None:
    """What the message suggests trains: the metric gets the targets and the logits."""
    torch.manual_seed(0)
    batches = [{"pixels": torch.randn(8, 4), "digit": torch.randint(0, 3, (8,))}]
    model = DictModel("pixels", "digit")
    metrics = Metrics(acc=accuracy, targets=lambda batch: batch["digit"],
                      outputs=lambda outputs: outputs["logits"])
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, val_data=batches,
                device="cpu", callbacks=[metrics], sanity_val_batches=0)
    state = loop.fit(1)
    with torch.no_grad():
        expected = accuracy(model.linear(batches[0]["pixels"]), batches[0]["digit"]).item()
    assert state.metrics["val_acc"] == pytest.approx(expected)


def test_a_tuple_batch_without_targets_points_at_its_last_item() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(8, 4), torch.randn(8, 3), torch.randint(0, 3, (8,)))]
    model = torch.nn.Linear(4, 3)

    def forward(loop: Loop, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = loop.model(batch[0])
        return outputs, F.cross_entropy(outputs, batch[2])

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, val_data=batches,
                device="cpu", forward=forward, callbacks=[Metrics(acc=accuracy)])
    with pytest.raises(ConfigurationError) as caught:
        loop.fit(1)
    message = str(caught.value)
    assert "a tuple of 3 item(s)" in message
    assert "Metrics(..., targets=lambda batch: batch[2])" in message


def test_the_suggested_loop_rule_works() -> None:
    """Loop(..., targets=key), the message's first option, gives Metrics the targets too."""
    torch.manual_seed(0)
    batches = [{"pixels": torch.randn(8, 4), "digit": torch.randint(0, 3, (8,))}]
    model = DictModel("pixels", "digit")
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, val_data=batches,
                device="cpu", targets="digit", sanity_val_batches=0,
                callbacks=[Metrics(acc=accuracy, outputs=lambda outputs: outputs["logits"])])
    state = loop.fit(1)
    with torch.no_grad():
        expected = accuracy(model.linear(batches[0]["pixels"]), batches[0]["digit"]).item()
    assert state.metrics["val_acc"] == pytest.approx(expected)
