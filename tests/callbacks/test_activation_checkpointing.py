"""ActivationCheckpointing: the same gradients as the run without it (dropout inside the
checkpointed blocks, full and selective), clean state-dict keys, less saved memory, and
the order with Compile and FSDP checked before the first batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from builders import same_weights, weights
from torch import nn

from hookloop import CallbackOrderError, ConfigurationError, Loop, load_checkpoint
from hookloop.callbacks import FSDP, ActivationCheckpointing, Checkpoint, Compile
from hookloop.callbacks.activation_checkpointing import saved_activation_bytes

SELECTIVE = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]


class Block(nn.Module):
    """A residual MLP block with dropout inside: a recompute with another mask shows."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(self.drop(torch.relu(self.up(hidden))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(8), Block(8), nn.Linear(8, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator))
            for _ in range(3)]


def hand_trained(epochs: int = 2) -> nn.Module:
    """The oracle: a plain torch loop without checkpointing, the same draws in the same order."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(11)
    for _ in range(epochs):
        for inputs, targets in batches():
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step()
    return model


def loop_with(callbacks: list, **options) -> Loop:
    model = make_model()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.05), batches(),
                loss_fn=F.mse_loss, device="cpu", callbacks=callbacks, sanity_val_batches=0,
                **options)
    torch.manual_seed(11)
    return loop


@pytest.mark.parametrize("policy", [None, SELECTIVE], ids=["full", "selective"])
def test_weights_are_bit_identical_to_training_without_checkpointing(policy) -> None:
    loop = loop_with([ActivationCheckpointing(wrap={Block}, policy=policy)])
    loop.fit(2)
    assert same_weights(loop, hand_trained())


@pytest.mark.parametrize("policy", [None, SELECTIVE], ids=["full", "selective"])
def test_gradients_are_bit_identical_with_dropout(policy) -> None:
    plain, checkpointed = make_model(), make_model()
    callback = ActivationCheckpointing(wrap={Block}, policy=policy)
    loop = Loop(checkpointed, torch.optim.SGD(checkpointed.parameters(), lr=0.1), batches(),
                loss_fn=F.mse_loss, device="cpu", callbacks=[callback])
    callback.setup(loop)
    assert callback.blocks == [checkpointed[0], checkpointed[1]]
    inputs, targets = batches()[0]
    for model in (plain, checkpointed):
        torch.manual_seed(5)
        F.mse_loss(model(inputs), targets).backward()
    for (name, first), second in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(first.grad, second.grad), name
    # the dropout really drew: another seed gives other gradients
    other = make_model()
    torch.manual_seed(6)
    F.mse_loss(other(inputs), targets).backward()
    assert not torch.equal(other[0].up.weight.grad, plain[0].up.weight.grad)


def test_checkpointing_saves_fewer_activation_bytes() -> None:
    inputs = torch.randn(64, 8)
    plain, checkpointed = make_model(), make_model()
    ActivationCheckpointing(wrap={Block}).setup(
        Loop(checkpointed, torch.optim.SGD(checkpointed.parameters(), lr=0.1), batches(),
             loss_fn=F.mse_loss, device="cpu"))
    without = saved_activation_bytes(lambda: plain(inputs).sum(), plain)
    with_checkpoints = saved_activation_bytes(lambda: checkpointed(inputs).sum(), checkpointed)
    # Without: each block keeps at least its input (64 x 8 floats), the relu's output and
    # the dropped-out activations (64 x 32 floats each), besides dropout's mask; with: each
    # block keeps only its input, and the head its own.
    block_input, hidden = 64 * 8 * 4, 64 * 32 * 4
    assert without >= 2 * (block_input + 2 * hidden) + block_input
    assert with_checkpoints == 3 * block_input


def test_state_dict_keys_stay_clean_and_a_checkpoint_loads_into_a_plain_model(tmp_path) -> None:
    loop = loop_with([ActivationCheckpointing(wrap={Block}), Checkpoint(tmp_path)])
    loop.fit(1)
    assert list(loop.model.state_dict()) == list(make_model().state_dict())
    plain = make_model()
    load_checkpoint(next(tmp_path.glob("*.pt")), plain)
    assert same_weights(plain, loop.model)


def test_a_second_fit_does_not_checkpoint_twice_and_deep_copies_run_their_own_block() -> None:
    callback = ActivationCheckpointing(wrap={Block})
    loop = loop_with([callback])
    loop.fit(1)
    first = loop.model[0].forward
    loop.fit(2)
    assert loop.model[0].forward is first
    assert first.forward.__self__ is loop.model[0]  # the block's own forward, not a wrapper's
    twin = copy.deepcopy(loop.model)
    assert twin[0].forward.forward.__self__ is twin[0]
    with torch.no_grad():
        twin[0].up.weight.zero_()
    assert not torch.equal(twin(torch.ones(2, 8)), loop.model(torch.ones(2, 8)))


def test_validation_and_predict_run_the_blocks_without_checkpoint(monkeypatch) -> None:
    callback = ActivationCheckpointing(wrap={Block})
    loop = loop_with([callback], val_data=batches()[:1])
    loop.fit(1)
    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *args, **kwargs: calls.append(1) or checkpoint(*args, **kwargs))
    reference = make_model()
    reference.load_state_dict(weights(loop))
    reference.eval()
    with torch.no_grad():
        expected = reference(batches()[0][0])
    assert torch.equal(torch.as_tensor(loop.predict([batches()[0][0]])), expected.flatten()) or \
        torch.equal(torch.as_tensor(loop.predict([batches()[0][0]])), expected)
    loop.validate()
    assert calls == []
    loop.model.train()
    F.mse_loss(loop.model(batches()[0][0]), batches()[0][1]).backward()
    assert calls == [1, 1]  # training forwards do run under it


def test_compile_before_checkpointing_is_refused_naming_both() -> None:
    loop = loop_with([Compile(backend="eager"), ActivationCheckpointing(wrap={Block})])
    with pytest.raises(CallbackOrderError, match=r"Compile.*ActivationCheckpointing.*Move "
                                                 r"ActivationCheckpointing before Compile"):
        loop.fit(1)


def test_checkpointing_after_fsdp_is_refused_naming_both() -> None:
    loop = loop_with([FSDP(), ActivationCheckpointing(wrap={Block})])
    with pytest.raises(CallbackOrderError, match=r"FSDP.*ActivationCheckpointing.*Move "
                                                 r"ActivationCheckpointing before FSDP"):
        loop.fit(1)


def test_compile_after_checkpointing_trains_as_without() -> None:
    # aot_eager: torch's "eager" backend does not replay the dropout of a checkpointed
    # block in its recompute (docs/callbacks/activation_checkpointing.md); aot_eager and
    # inductor do.
    loop = loop_with([ActivationCheckpointing(wrap={Block}), Compile(backend="aot_eager")])
    loop.fit(2)
    torch.testing.assert_close(weights(loop), weights(hand_trained()), rtol=0, atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="policy must be None"):
        ActivationCheckpointing(policy=["mm"])
    with pytest.raises(ConfigurationError, match="wrap"):
        ActivationCheckpointing(wrap=3)
    loop = loop_with([ActivationCheckpointing(wrap={nn.Conv2d})])
    with pytest.raises(ConfigurationError, match="chooses no block"):
        loop.fit(1)
