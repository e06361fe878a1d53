"""CudaSpeedups: on CPU a no-op said once; on CUDA (a loop on a CUDA device, faked) the
switches set for the fit and put back after it."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hookloop import ConfigurationError, Loop
from hookloop.callbacks import CudaSpeedups


def switches() -> tuple[bool, bool, bool]:
    return (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


@pytest.fixture(autouse=True)
def _restore_switches():
    saved = switches()
    yield
    (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
     torch.backends.cudnn.allow_tf32) = saved


def test_on_cpu_nothing_changes_and_it_is_said_once() -> None:
    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1))]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data, loss_fn=F.mse_loss,
                callbacks=[CudaSpeedups()], device="cpu")
    before = switches()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loop.fit(1)
        loop.fit(2)
    assert [str(w.message)[:36] for w in said] == ["CudaSpeedups: the loop runs on cpu, "]
    assert said[0].filename == __file__  # it points at the fit() call
    assert switches() == before


@pytest.mark.parametrize("cudnn_benchmark, tf32", [(True, True), (False, True), (True, False)])
def test_on_cuda_the_switches_hold_for_the_fit(cudnn_benchmark: bool, tf32: bool) -> None:
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loop = SimpleNamespace(device=torch.device("cuda"))
    speedups = CudaSpeedups(cudnn_benchmark=cudnn_benchmark, tf32=tf32)
    speedups.on_fit_start(loop)
    assert switches() == (cudnn_benchmark, tf32, tf32)
    speedups.on_fit_end(loop)
    assert switches() == (False, False, False)


def test_settings_must_be_bools() -> None:
    with pytest.raises(ConfigurationError, match="CudaSpeedups tf32 must be"):
        CudaSpeedups(tf32="yes")
