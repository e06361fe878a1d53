"""DDP(sync_batchnorm=True)'s conversion (issue 19, item 5): torch's SyncBatchNorm replaces
the BatchNorm layers, on CPU too (only a training forward under a process group needs
CUDA); the torchrun tests are tests/distributed/test_ddp_sync_batchnorm_torchrun.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hookloop import ConfigurationError
from hookloop.callbacks import DDP
from hookloop.callbacks.ddp import sync_batchnorm


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.BatchNorm1d(5)))


def test_the_conversion_keeps_the_tensors_and_the_state_dict() -> None:
    """On CPU, without training: torch converts there; only training forward needs CUDA."""
    model = bn_model()
    model.train()
    for _ in range(2):  # running statistics worth keeping
        model(torch.randn(6, 3, 8, 8))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    parameters = [id(parameter) for parameter in model.parameters()]
    buffers = [id(buffer) for buffer in model.buffers()]
    converted = sync_batchnorm(model)
    assert converted is model  # converted in place below the top
    assert [type(layer).__name__ for layer in model.modules() if "Norm" in type(layer).__name__
            ] == ["SyncBatchNorm", "SyncBatchNorm"]
    assert [id(parameter) for parameter in model.parameters()] == parameters  # the optimizer's
    assert [id(buffer) for buffer in model.buffers()] == buffers
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)
    layers = [id(layer) for layer in model.modules()]
    assert sync_batchnorm(model) is model  # converted layers are left as they are
    assert [id(layer) for layer in model.modules()] == layers


def test_converted_layers_compute_batchnorm_in_eval_and_without_a_group() -> None:
    plain, converted = bn_model(), sync_batchnorm(bn_model())
    inputs = torch.randn(6, 3, 8, 8)
    plain.eval(), converted.eval()
    assert torch.equal(plain(inputs), converted(inputs))
    plain.train(), converted.train()  # no process group: torch falls back to BatchNorm
    assert torch.equal(plain(inputs), converted(inputs))


def test_a_top_level_batchnorm_is_replaced() -> None:
    layer = nn.BatchNorm1d(3)
    converted = sync_batchnorm(layer)
    assert isinstance(converted, nn.SyncBatchNorm) and converted.weight is layer.weight


def test_the_option_is_a_flag_and_shows_in_the_repr() -> None:
    assert "sync_batchnorm=True" in repr(DDP(sync_batchnorm=True))
    assert "sync_batchnorm" not in repr(DDP())
    with pytest.raises(ConfigurationError, match="DDP sync_batchnorm must be"):
        DDP(sync_batchnorm="yes")  # type: ignore[arg-type]
