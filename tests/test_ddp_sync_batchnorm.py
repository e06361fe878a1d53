"""DDP(sync_batchnorm=True) (issue 19, item 5): torch's SyncBatchNorm before wrapping, on
CUDA; refused on CPU, by name, before the first batch (torchrun, 2 ranks, gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import ROOT, subprocess_env
from hookloop import ConfigurationError
from hookloop.callbacks import DDP
from hookloop.callbacks.ddp import sync_batchnorm

SCRIPT = ROOT / "tests" / "ddp_scripts" / "sync_batchnorm.py"
TIMEOUT = 150


def torchrun(processes: int, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the script on ``processes`` ranks; kill the process group if it overruns."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", str(SCRIPT), *args]
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), env["PYTHONPATH"]])
    env.pop("RANK", None)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{SCRIPT.name} hung: killed after {TIMEOUT} s\n{output[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def test_refused_on_cpu_under_torchrun_by_name(tmp_path: Path) -> None:
    result = torchrun(2, str(tmp_path), "cpu", "sync")
    assert result.returncode != 0
    message = "DDP(sync_batchnorm=True) needs CUDA, but this run trains on cpu"
    assert result.stdout.count(message) >= 2, result.stdout[-6000:]  # on both ranks
    assert "ConfigurationError" in result.stdout
    assert not list(tmp_path.glob("result.*"))  # refused before training


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SyncBatchNorm trains only on CUDA")
def test_on_cuda_the_model_trains_with_its_batchnorm_converted(tmp_path: Path) -> None:
    """One rank per GPU (NCCL): the layers train as SyncBatchNorm; with one rank they compute
    what BatchNorm computes, so the weights equal those of the same run without the option."""
    runs = {}
    for mode in ("sync", "plain"):
        out = tmp_path / mode
        result = torchrun(1, str(out), "cuda", mode)
        assert result.returncode == 0, result.stdout[-8000:]
        runs[mode] = (json.loads((out / "result.rank0.json").read_text()),
                      torch.load(out / "weights.rank0.pt", weights_only=True))
    (synced, synced_weights), (plain, plain_weights) = runs["sync"], runs["plain"]
    assert synced["types"] == ["SyncBatchNorm"] and plain["types"] == ["BatchNorm1d"]
    assert synced["step"] == plain["step"] == 2 * 8
    for key, value in plain_weights.items():
        torch.testing.assert_close(synced_weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert synced["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-5)
