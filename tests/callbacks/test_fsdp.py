"""The FSDP callback in one process: a no-op outside torchrun, its arguments, its place in a
stack, the blocks of the default wrap; and, in a real one-process gloo group, the model
sharded, the optimizer re-pointed, training equal to an unsharded loop, and sharded
checkpoints (directories: rotation, best, resume, a failed save, load_checkpoint).
Two real processes under torchrun are in tests/distributed/test_fsdp_two_processes.py."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from builders import make_loop, regression_dataset, same_weights
from torch import nn
from torch.utils.data import DataLoader

from hookloop import Callback, CallbackOrderError, ConfigurationError, Loop, load_checkpoint
from hookloop.callbacks import DDP, EMA, FSDP, Checkpoint, GradClip
from hookloop.callbacks.fsdp import default_blocks
from hookloop.errors import CheckpointWriteError
from hookloop.runfile.sharded import is_sharded_module, is_sharded_tensor

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _loader() -> DataLoader:
    return DataLoader(regression_dataset(24, seed=1), batch_size=4)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    weights = [param for name, param in model.named_parameters() if name.endswith("weight")]
    biases = [param for name, param in model.named_parameters() if name.endswith("bias")]
    return torch.optim.AdamW([{"params": biases, "weight_decay": 0.0},
                              {"params": weights, "weight_decay": 0.1, "lr": 0.02}], lr=0.01)


def _loop(callbacks: list[Any], **options: Any) -> Loop:
    model = _model()
    return Loop(model, _optimizer(model), _loader(), loss_fn=nn.functional.mse_loss,
                device="cpu", callbacks=callbacks, **options)


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torchrun's environment for a world of one process; the group FSDP leaves (the model's
    shards live on it) is destroyed after the test, so no other test sees it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# -------------------------------------------------------------------- one process
def test_outside_torchrun_fsdp_does_nothing_and_says_so_once(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    for name in _TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    loop = _loop([FSDP()])
    model = loop.model
    with pytest.warns(UserWarning, match="FSDP: not launched by torchrun") as record:
        loop.fit(1)
        loop.fit(2)
    assert len([w for w in record if "torchrun" in str(w.message)]) == 1
    assert loop.model is model and not is_sharded_module(model)
    plain = _loop([])
    plain.fit(2)
    assert same_weights(loop, plain)


BAD_ARGUMENTS = [
    ("wrap", 3, "None, a set of nn.Module classes or a callable module -> bool"),
    ("wrap", {int}, "None, a set of nn.Module classes or a callable module -> bool"),
    ("mixed_precision", torch.int8, "one of torch.bfloat16, torch.float16, torch.float32"),
    ("mixed_precision", "bf16", "None, a dtype or a torch.distributed.fsdp.MixedPrecisionPolicy"),
    ("reshard_after_forward", "yes", "True or False"),
    ("cpu_offload", 1, "True or False"),
    ("state_dict", "both", "one of 'full', 'sharded'"),
]


@pytest.mark.parametrize(("argument", "value", "requirement"), BAD_ARGUMENTS)
def test_bad_arguments_are_refused_in_the_one_message_form(argument: str, value: Any,
                                                           requirement: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        FSDP(**{argument: value})
    assert str(caught.value).startswith(f"FSDP {argument} must be {requirement}, got {value!r}.")


def test_ddp_and_fsdp_in_one_stack_is_an_ordering_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    loop = make_loop([DDP(), FSDP()])
    with pytest.raises(CallbackOrderError, match=r"FSDP\(.*cannot be used with DDP"):
        loop.fit(1)


def test_default_blocks_look_into_module_lists_and_leave_tied_and_small_modules() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.norm = nn.LayerNorm(16)  # 32 parameters of about 2500: not on its own
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight  # tied: both stay with the root

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(tokens)
            for block in self.blocks:
                hidden = block(hidden)
            return self.head(self.norm(hidden))

    net = Net()
    assert default_blocks(net) == list(net.blocks)


# ------------------------------------------------------ a real one-process group
def test_the_model_is_sharded_and_the_optimizer_re_pointed_keeping_its_groups(
        one_process_group: None) -> None:
    loop = _loop([FSDP()])
    optimizer = loop.optimizer
    groups_before = [{key: value for key, value in group.items() if key != "params"}
                     for group in optimizer.param_groups]
    names_before = [[name for param in group["params"] for name, other in
                     loop.model.named_parameters() if other is param]
                    for group in optimizer.param_groups]
    loop.fit(1)
    model = loop.model
    assert is_sharded_module(model) and all(is_sharded_tensor(p) for p in model.parameters())
    assert loop.optimizer is optimizer
    assert [{key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups] == groups_before
    by_name = dict(model.named_parameters())
    assert [[id(param) for param in group["params"]] for group in optimizer.param_groups] == \
        [[id(by_name[name]) for name in names] for names in names_before]
    assert optimizer.state  # it stepped the shards


def test_one_rank_fsdp_trains_as_an_unsharded_loop(one_process_group: None) -> None:
    sharded = _loop([FSDP(), GradClip(0.05)])
    sharded.fit(2)
    plain = _loop([GradClip(0.05)])
    plain.fit(2)
    gathered = {name: value.full_tensor() for name, value in sharded.model.state_dict().items()}
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(gathered[name], value, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(sharded.state.grad_norm, plain.state.grad_norm, rtol=1e-6,
                               atol=0)


def test_clipping_by_value_of_shards_clips_as_an_unsharded_loop(one_process_group: None
                                                                 ) -> None:
    sharded = _loop([FSDP(), GradClip(max_value=0.01)])
    sharded.fit(1)
    plain = _loop([GradClip(max_value=0.01)])
    plain.fit(1)
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(sharded.model.state_dict()[name].full_tensor(), value,
                                   rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(sharded.state.grad_norm, plain.state.grad_norm, rtol=1e-6,
                               atol=0)


def test_an_optimizer_over_other_tensors_or_one_that_stepped_is_refused(
        one_process_group: None) -> None:
    model = _model()
    extra = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    loop = Loop(model, optimizer, _loader(), loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[FSDP()])
    with pytest.raises(ConfigurationError, match="not parameters of the model"):
        loop.fit(1)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    loop = Loop(model, optimizer, _loader(), loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[FSDP()])
    with pytest.raises(ConfigurationError, match="has stepped already"):
        loop.fit(1)


def _entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_sharded_checkpoints_are_directories_that_rotate_rank_and_resume(
        one_process_group: None, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    whole = _loop([FSDP(state_dict="sharded"), EMA(0.9),
                   Checkpoint(tmp_path / "whole", monitor="val_loss", save_top_k=2)],
                  val_data=_loader())
    whole.fit(3)
    first = _loop([FSDP(state_dict="sharded"), EMA(0.9),
                   Checkpoint(directory, monitor="val_loss", save_top_k=2)], val_data=_loader())
    first.fit(2)
    names = _entries(directory)
    assert [name for name in names if name.startswith("epoch=")] == ["epoch=0001-step=00000012.dcp"]
    assert "best.dcp" in names and sum(name.startswith("best-val_loss=") for name in names) == 2
    assert all(os.path.isdir(directory / name) for name in names if name.endswith(".dcp"))
    resumed = _loop([FSDP(state_dict="sharded"), EMA(0.9),
                     Checkpoint(directory, monitor="val_loss", save_top_k=2, resume=True)],
                    val_data=_loader())
    resumed.fit(3)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name].full_tensor(), value.full_tensor())
    assert [entry["value"] for entry in resumed.callbacks[2].top_k] == \
        [entry["value"] for entry in whole.callbacks[2].top_k]
    # The best directory loads into an unsharded model, for inference.
    plain = _model()
    load_checkpoint(directory / "best.dcp", plain)
    best = resumed.callbacks[2].top_k[0]
    assert best["step"] in (12, 18)


def test_a_failed_sharded_save_leaves_no_directory_and_the_earlier_ones_intact(
        one_process_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "ckpt"
    loop = _loop([FSDP(state_dict="sharded"), Checkpoint(directory, keep_last=2)])
    loop.fit(1)
    before = _entries(directory)
    original = dcp.save

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match="no space left on the device"):
        loop.fit(2)
    monkeypatch.setattr(dcp, "save", original)
    assert _entries(directory) == before  # nothing new, nothing lost, no temporary left


def test_a_full_checkpoint_of_a_sharded_model_is_one_file_of_the_usual_format(
        one_process_group: None, tmp_path: Path) -> None:
    loop = _loop([FSDP(state_dict="full"), Checkpoint(tmp_path)])
    loop.fit(1)
    plain = _model()
    optimizer = _optimizer(plain)
    contents = load_checkpoint(tmp_path / "epoch=0000-step=00000006.pt", plain, optimizer)
    for name, value in loop.model.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value.full_tensor())
    assert sorted(contents["optimizer"]["state"]) == list(range(6))  # numbered, as torch does
    assert len(optimizer.state) == 6


def _user_dtensor_loop(directory: Path, resume: bool, *extra: Any, **checkpoint: Any) -> Loop:
    """A model whose parameters the user made DTensors (``distribute_module``), without FSDP
    or TensorParallel in the stack (the group: `one_process_group`, initialized here)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))

    def forward(loop: Loop, batch: Any) -> tuple[Any, torch.Tensor]:
        inputs, targets = batch
        out = loop.model(DTensor.from_local(inputs, mesh, [Replicate()])).to_local()
        return out, nn.functional.mse_loss(out, targets)

    model = distribute_module(_model(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # no state: see below
    return Loop(model, optimizer, _loader(), forward=forward, device="cpu",
                callbacks=[Checkpoint(directory, resume=resume, **checkpoint), *extra])


def test_a_model_the_user_made_of_dtensors_saves_shards_and_resumes_exactly(
        one_process_group: None, tmp_path: Path) -> None:
    """No layout is recorded; the model's own DTensor parameters still make each save a
    directory of shards, decided once at the fit's start, and a resume continues into the
    uninterrupted run. (An optimizer with state over such a model does not resume: DCP
    misses its entries, a CheckpointError naming the file, before and after that decision
    moved.)"""
    whole = _user_dtensor_loop(tmp_path / "whole", False)
    whole.fit(2)
    _user_dtensor_loop(tmp_path / "ckpt", False).fit(1)
    assert _entries(tmp_path / "ckpt") == ["epoch=0000-step=00000006.dcp"]
    resumed = _user_dtensor_loop(tmp_path / "ckpt", True)
    resumed.fit(2)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name].full_tensor(), value.full_tensor())


class _Fails(Callback):
    def on_batch_end(self, loop: Loop) -> None:
        if loop.state.step == 3:
            raise RuntimeError("the step failed")


@pytest.mark.parametrize("sharded", ["FSDP", "DTensor parameters"])
def test_an_exception_writes_no_sharded_checkpoint_and_says_why(
        one_process_group: None, tmp_path: Path, sharded: str) -> None:
    """On the exception path the other ranks may be gone, so a sharded model's state (read
    and written by every rank together) is not saved; the newest file stays, and a note on
    the exception says why, whether FSDP shards the model or the user placed DTensors."""
    directory = tmp_path / "ckpt"
    loop = (_loop([FSDP(state_dict="sharded"), Checkpoint(directory, every_n_steps=2),
                   _Fails()]) if sharded == "FSDP"
            else _user_dtensor_loop(directory, False, _Fails(), every_n_steps=2))
    with pytest.raises(RuntimeError, match="the step failed") as raised:
        loop.fit(1)
    assert _entries(directory) == ["epoch=0000-step=00000002.dcp"]
    assert any("no checkpoint of the exception" in note for note in raised.value.__notes__)
