"""Loop(state=...): more stateful objects (a GAN's discriminator and its optimizer) saved in
Loop.state_dict() and restored before on_fit_start (issue 16 item 15). The oracle is the
run that was never restored, continued in the same process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, CheckpointError, ConfigurationError, Loop


def _gan(seed: int = 0):
    torch.manual_seed(seed)
    generator, discriminator = nn.Linear(3, 4), nn.Linear(4, 1)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=0.01)
    data = [(torch.randn(5, 4, generator=torch.Generator().manual_seed(i)), torch.zeros(5))
            for i in range(4)]

    def forward(loop, batch):
        real, _ = batch
        fake = generator(torch.randn(real.shape[0], 3))
        opt_d.zero_grad()
        scores = discriminator(torch.cat([real, fake.detach()])).squeeze(1)
        labels = torch.cat([torch.ones(len(real)), torch.zeros(len(real))])
        F.binary_cross_entropy_with_logits(scores, labels).backward()
        opt_d.step()
        return fake, F.binary_cross_entropy_with_logits(
            discriminator(fake).squeeze(1), torch.ones(len(real)))

    loop = Loop(generator, torch.optim.Adam(generator.parameters(), lr=0.01), data,
                forward=forward, device="cpu",
                state={"discriminator": discriminator, "opt_d": opt_d})
    return loop, discriminator, opt_d


def _same(first: nn.Module, second: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first.state_dict().values(),
                                                 second.state_dict().values()))


def test_the_extra_objects_are_saved_and_restored_before_on_fit_start() -> None:
    reference, reference_d, reference_opt = _gan()
    reference.fit(1)
    saved = copy.deepcopy(reference.state_dict())  # the tensors are the live ones
    assert set(saved["state"]) == {"discriminator", "opt_d"}
    reference.fit(3)
    resumed, resumed_d, resumed_opt = _gan(seed=1)  # other initial weights everywhere

    class Sees(Callback):
        def on_fit_start(self, loop):
            self.same = all(torch.equal(resumed_d.state_dict()[name], value)
                            for name, value in saved["state"]["discriminator"].items())

    sees = Sees()
    resumed.callbacks.append(sees)
    resumed.load_state_dict(saved)
    resumed.fit(3)
    assert sees.same  # restored before on_fit_start
    assert _same(resumed_d, reference_d) and _same(resumed.model, reference.model)
    assert resumed_opt.state_dict()["state"][0]["step"] == reference_opt.state_dict()["state"][0]["step"]


def test_an_extra_object_of_another_class_is_refused_by_name() -> None:
    reference, _, _ = _gan()
    reference.fit(1)
    saved = reference.state_dict()
    other, discriminator, _ = _gan()
    other.extra_state["opt_d"] = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    other.load_state_dict(saved, source="run.pt")
    with pytest.raises(CheckpointError, match=r"run\.pt: state\['opt_d'\] was saved from the class Adam, but "
                       r"this loop's state\['opt_d'\] is of the class SGD"):
        other.fit(2)


def test_a_missing_extra_state_starts_fresh_with_a_warning() -> None:
    reference, _, _ = _gan()
    reference.fit(1)
    saved = reference.state_dict()
    del saved["state"]["opt_d"]
    resumed, _, _ = _gan()
    resumed.load_state_dict(saved, source="run.pt")
    with pytest.warns(RuntimeWarning, match=r"run\.pt has no state for Loop\(state=\{'opt_d'"):
        resumed.fit(2)


SHARED = nn.Linear(2, 1)


@pytest.mark.parametrize("state, message", [
    ([1, 2], "Loop state must be a dict"),
    ({"": nn.Linear(1, 1)}, "Loop state key must be a non-empty string"),
    ({"counter": 3}, r"Loop state\['counter'\] \(of type int\) has no state_dict\(\)"),
    # Issue 25, item 10: a class has the methods (unbound) and failed at the first save.
    ({"x": nn.Linear}, r"Loop state\['x'\] is the class Linear, not an instance.*Linear\(\.\.\.\)"),
    ({"a": SHARED, "b": SHARED}, r"state\['a'\] and state\['b'\] are the same Linear object"),
])
def test_bad_state_arguments_are_refused_when_the_loop_is_built(state, message) -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigurationError, match=message):
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.ones(1, 2),
             torch.ones(1, 1))], loss_fn=F.mse_loss, device="cpu", state=state)


def test_the_loops_own_model_or_optimizer_in_state_is_refused_when_built() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, item, what in (("net", model, "model"), ("opt", optimizer, "optimizer")):
        with pytest.raises(ConfigurationError, match=rf"state\['{name}'\] is the loop's {what}"):
            Loop(model, optimizer, [(torch.ones(1, 2), torch.ones(1, 1))], loss_fn=F.mse_loss,
                 device="cpu", state={name: item})


class _HoldsAFunction:
    """A stateful object whose state holds a function: no checkpoint can hold it."""

    def __init__(self) -> None:
        self.schedule = lambda step: 0.5 ** step

    def state_dict(self) -> dict:
        return {"schedule": self.schedule}

    def load_state_dict(self, state: dict) -> None:
        self.schedule = state["schedule"]


def test_a_state_object_whose_state_holds_a_function_is_refused_at_fit_start(tmp_path) -> None:
    """Issue 25, item 10: refused only at the first save (after training began) before;
    now at fit start, before the first batch, naming the object and the key, with or
    without a Checkpoint in the stack."""
    from hookloop.callbacks import Checkpoint

    from builders import BatchCounter

    model = nn.Linear(2, 1)
    counter = BatchCounter()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1),
                [(torch.ones(1, 2), torch.ones(1, 1))] * 3, loss_fn=F.mse_loss, device="cpu",
                state={"holder": _HoldsAFunction()}, callbacks=[counter, Checkpoint(tmp_path)])
    with pytest.raises(ConfigurationError, match=r"Loop state\['holder'\]\.state_dict\(\)"
                                                 r"\['schedule'\] is a builtins\.function.*"
                                                 r"_HoldsAFunction return only tensors"):
        loop.fit(1)
    assert counter.batches == 0
    assert not list(tmp_path.glob("*.pt"))  # nothing trained, nothing saved
