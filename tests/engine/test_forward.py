"""How the loop gets outputs and a loss from a batch (hookloop/engine/forward.py): the four rules,
a custom forward, and the errors that say which rule a batch or a loss broke."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import Callback, ConfigurationError, Loop

from builders import MLP, make_loop, shuffled_run


def test_custom_forward_is_used_as_is() -> None:
    calls = []

    def forward(loop, batch):
        inputs, targets = batch
        calls.append(loop.state.training)
        outputs = loop.model(inputs)
        return outputs, F.cross_entropy(outputs, targets) * 0 + 2.5 + outputs.sum() * 0

    model = MLP()
    data = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(2)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, val_data=data[:1],
                loss_fn=F.mse_loss, forward=forward, device="cpu", sanity_val_batches=0)
    state = loop.fit(1)
    assert calls == [True, True, False]
    assert state.metrics["train_loss"] == pytest.approx(2.5)
    assert state.metrics["val_loss"] == pytest.approx(2.5)


def test_model_output_with_loss_attribute_is_accepted() -> None:
    Output = collections.namedtuple("Output", "logits loss")

    class AttrModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x, targets):
            logits = self.mlp(x)
            return Output(logits, F.cross_entropy(logits, targets))

    model = AttrModel()
    data = [{"x": torch.randn(4, 6), "targets": torch.randint(0, 3, (4,))}]
    seen = []

    class Spy(Callback):
        def after_forward(self, loop):
            seen.append((loop.state.targets, loop.state.batch_size))

    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, callbacks=[Spy()],
         device="cpu").fit(1)
    assert torch.equal(seen[0][0], data[0]["targets"]) and seen[0][1] == 4


def _fit_error(batch, **kwargs) -> str:
    loop = make_loop(model=kwargs.pop("model", MLP()), train=[batch],
                     loss_fn=kwargs.pop("loss_fn", None), seed=None, **kwargs)
    with pytest.raises(ConfigurationError) as info:
        loop.fit(1)
    return str(info.value)


def test_pair_without_loss_fn_says_what_to_pass() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])))
    assert "(inputs, targets) pair" in message and "loss_fn=" in message and "forward=" in message


def test_mapping_output_without_loss_lists_its_keys() -> None:
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x):
            return {"logits": self.mlp(x)}

    message = _fit_error({"x": torch.randn(2, 6)}, model=NoLoss())
    assert "model(**batch)" in message and "logits" in message and "'loss'" in message


def test_unusable_batch_lists_the_three_rules() -> None:
    message = _fit_error(torch.randn(2, 6))
    assert "Tensor" in message
    assert "forward=" in message and "loss_fn=" in message and "mapping" in message


def test_non_scalar_loss_is_reported_with_its_shape() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])),
                         loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"))
    assert "shape (2,)" in message and "reduction='mean'" in message


def test_loss_without_grad_is_reported() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])),
                         loss_fn=lambda out, y: F.cross_entropy(out.detach(), y))
    assert "does not require grad" in message


def test_forward_returning_one_value_is_reported() -> None:
    message = _fit_error((torch.randn(2, 6), torch.tensor([0, 1])),
                         forward=lambda loop, batch: loop.model(batch[0]).sum())
    assert "(outputs, loss)" in message


def test_a_replaced_loss_that_is_not_a_scalar_is_reported() -> None:
    class Broken(Callback):
        def after_forward(self, loop: Loop) -> None:
            loop.state.loss = loop.state.loss.expand(3)

    _, loop = shuffled_run([Broken()])
    with pytest.raises(ConfigurationError, match="after_forward must be a scalar.*shape \\(3,\\)"):
        loop.fit(1)


def test_a_loss_fn_a_callback_sets_in_setup_or_mid_fit_is_the_one_used() -> None:
    """The forward rule reads the loop's loss_fn/forward at each use, as it did before the
    helpers were handed values (found in review): a callback that sets ``loop.loss_fn`` in
    ``setup``, or swaps it at an epoch's start (a curriculum), is obeyed."""
    import torch

    from hookloop import Callback, Loop

    calls: list[str] = []

    def first(outputs, targets):
        calls.append("first")
        return torch.nn.functional.mse_loss(outputs, targets)

    def second(outputs, targets):
        calls.append("second")
        return torch.nn.functional.l1_loss(outputs, targets)

    class Curriculum(Callback):
        def setup(self, loop):
            loop.loss_fn = first

        def on_epoch_start(self, loop):
            if loop.state.epoch == 1:
                loop.loss_fn = second

    model = torch.nn.Linear(3, 1)
    data = [(torch.ones(2, 3), torch.zeros(2, 1)) for _ in range(3)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=torch.nn.functional.mse_loss, device="cpu", callbacks=[Curriculum()])
    loop.fit(2)
    assert calls == ["first"] * 3 + ["second"] * 3


@pytest.mark.parametrize("placement", ["Replicate", "Partial"])
def test_a_dtensor_loss_trains_records_and_saves_as_the_plain_loss(tmp_path, placement) -> None:
    """A loss that is a DTensor (tensor parallel's loss_parallel gives a replicated one) on
    a one-process gloo group: the fit equals the plain loss's bit for bit, state.loss is a
    plain tensor, and a checkpoint saves (the DTensor broke the epoch sums and the save)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from hookloop.callbacks import Checkpoint

    kinds: set[str] = set()

    class LossKind(Callback):
        def after_forward(self, loop):
            kinds.add(type(loop.state.loss).__name__)

    def run(forward, callbacks=()):
        loop = make_loop([*callbacks, LossKind()], val=slice(0, 2), forward=forward)
        return loop, loop.fit(2)

    def plain(loop, batch):
        outputs = loop.model(batch[0])
        return outputs, F.mse_loss(outputs, batch[1])

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layout = [Replicate() if placement == "Replicate" else Partial()]

        def distributed(loop, batch):
            outputs, loss = plain(loop, batch)
            return outputs, DTensor.from_local(loss, mesh, layout)

        ours, ours_state = run(distributed, [Checkpoint(tmp_path / "checkpoints")])
        assert kinds == {"Tensor"}
        oracle, oracle_state = run(plain)
    finally:
        dist.destroy_process_group()
    assert ours_state.history == oracle_state.history
    assert all(torch.equal(a, b) for a, b in zip(ours.model.parameters(),
                                                  oracle.model.parameters()))
    (last,) = (tmp_path / "checkpoints").glob("epoch=0001-*.pt")
    saved = torch.load(last, weights_only=True)
    assert saved["loop"]["history"] == oracle_state.history
