"""ModelSummary and presets.debug() through the loop's own forward (issue 19, item 4): with
``forward=`` and dict batches the summary is taken from the inputs the forward gives the
model, its counts equal ``sum(p.numel())``, the run is bitwise the same with or without it,
and when it cannot work the warning says why and names ``input_size=``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Loop, presets
from hookloop.callbacks import ModelSummary


class Classifier(nn.Module):
    """Takes the image only; BatchNorm and dropout, so a probe that disturbed them shows."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(8, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(image))


def dict_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [{"image": torch.randn(4, 6, generator=generator),
             "label": torch.randint(0, 3, (4,), generator=generator)} for _ in range(3)]


def noisy_forward(loop: Loop, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws from torch's generator before calling the model, as augmentation does."""
    image = batch["image"] + 0.01 * torch.randn_like(batch["image"])
    outputs = loop.model(image)
    return outputs, F.cross_entropy(outputs, batch["label"])


def run(callbacks: list, forward=noisy_forward) -> Loop:
    torch.manual_seed(0)
    model = Classifier()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), dict_batches(),
                forward=forward, callbacks=callbacks, device="cpu")
    loop.fit(2)
    return loop


def parameters() -> int:
    return sum(parameter.numel() for parameter in Classifier().parameters())


def test_forward_and_dict_batches_are_summarized_through_the_forward() -> None:
    summary = ModelSummary(print_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not summarize" warning
        loop = run([summary])
    assert summary.summary is not None
    assert summary.summary.total_params == parameters() == 6 * 8 + 8 + 2 * 8 + 8 * 3 + 3
    assert summary.summary.trainable_params == parameters()
    assert summary.summary.summary_list[0].output_size == [4, 3]  # the real batch went through
    assert loop.state.step == 6


def test_the_run_is_bitwise_the_same_with_the_summary() -> None:
    with_summary, without = run([ModelSummary(print_summary=False)]), run([])
    for a, b in zip(with_summary.model.state_dict().values(), without.model.state_dict().values()):
        assert torch.equal(a, b)  # weights, BN statistics, the forward's and dropout's draws


def test_the_debug_preset_summarizes_forward_and_dict_batches(capsys: pytest.CaptureFixture
                                                               ) -> None:
    callbacks = presets.debug(steps=4, anomaly_steps=None, profile=False)
    loop = run(callbacks)
    summary = next(callback for callback in callbacks if isinstance(callback, ModelSummary))
    assert summary.summary.total_params == parameters()
    assert f"Total params: {parameters()}" in capsys.readouterr().out
    assert loop.state.step == 4


def test_a_forward_that_does_not_call_the_model_gets_a_warning_saying_why_and_how() -> None:
    def encoder_only(loop: Loop, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = loop.model.head(loop.model.encoder(batch["image"]))  # not loop.model(...)
        return outputs, F.cross_entropy(outputs, batch["label"])

    summary = ModelSummary(print_summary=False)
    with pytest.warns(RuntimeWarning) as caught:
        loop = run([summary], forward=encoder_only)
    message = str(caught[0].message)
    assert "without calling loop.model" in message and "input_size=" in message, message
    assert summary.summary is None and loop.state.step == 6  # training went on


def test_a_model_torchinfo_cannot_run_is_named_with_its_inputs_and_cause() -> None:
    def wrong_width(loop: Loop, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if loop.phase.fitting and not torch.is_grad_enabled():  # only the summary's probe
            outputs = loop.model(batch["image"][:, :5])
        else:
            outputs = loop.model(batch["image"])
        return outputs, F.cross_entropy(outputs, batch["label"])

    summary = ModelSummary(print_summary=False)
    with pytest.warns(RuntimeWarning, match=r"torchinfo failed on model\(Tensor\[4, 5\]\): "
                                            r"RuntimeError: mat1 and mat2 shapes cannot be "
                                            r"multiplied .*input_size="):
        run([summary], forward=wrong_width)
    assert summary.summary is None


def test_the_inputs_rule_of_the_loop_is_the_summary_s_too() -> None:
    """``Loop(inputs="image", targets="label")``: pair-style training of dict batches, and
    the summary takes the same input."""
    torch.manual_seed(0)
    model = Classifier()
    summary = ModelSummary(print_summary=False)
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), dict_batches(),
         loss_fn=F.cross_entropy, inputs="image", targets="label", callbacks=[summary],
         device="cpu").fit(1)
    assert summary.summary.total_params == parameters()
    assert summary.summary.summary_list[0].input_size == [4, 6]


def test_a_callable_inputs_rule_is_summarized_as_the_key_and_the_page_shows_the_rule() -> None:
    """Issue 28, item 3: ``inputs=fn(batch)`` gives the summary the same input as the key,
    and docs/callbacks/model_summary.md shows the ``inputs=``/``targets=`` rule in a block
    the docs test executes (its assertions compare with the page's printed shape)."""
    from pathlib import Path

    sizes = []
    for inputs in ("image", lambda batch: batch["image"]):
        torch.manual_seed(0)
        model = Classifier()
        summary = ModelSummary(print_summary=False)
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), dict_batches(),
             loss_fn=F.cross_entropy, inputs=inputs, targets="label", callbacks=[summary],
             device="cpu").fit(1)
        assert summary.summary.total_params == parameters()
        sizes.append(summary.summary.summary_list[0].input_size)
    assert sizes == [[4, 6], [4, 6]]
    page = (Path(__file__).resolve().parents[2] / "docs/callbacks/model_summary.md").read_text()
    blocks = page.split("```python\n")[1:]
    assert any('inputs="image", targets="label"' in block.split("```")[0] for block in blocks)
