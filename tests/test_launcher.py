"""hookloop.launcher: the process group from torchrun's environment, the message outside
torchrun (named after the callback that asked), and a group created again after a destroy.
Two real processes are in tests/distributed/."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from builders import make_loop, regression_dataset
from torch.utils.data import DataLoader

from hookloop import distributed, launcher
from hookloop.callbacks import DDP
from hookloop.launcher import Launch


def _loader() -> DataLoader:
    return DataLoader(regression_dataset(12), batch_size=4)

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def one_process_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's environment for a world of one process (a real gloo group can be made)."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)


def test_outside_torchrun_start_is_false_and_says_so_once_naming_the_owner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    assert not launcher.launched_by_torchrun()
    loop = make_loop()
    launch = Launch("FSDP")
    with pytest.warns(UserWarning, match=r"^FSDP: not launched by torchrun") as record:
        assert launch.start(loop, None) is False
        assert launch.start(loop, None) is False
    assert len(record) == 1
    assert not launch.active and not launch.created_group
    assert not distributed.is_initialized()


def test_a_fit_creates_the_group_and_destroys_it_and_a_second_fit_makes_a_new_one(
        one_process_torchrun: None) -> None:
    seen: list[tuple[bool, int]] = []

    class Probe(DDP):  # DDP through its Launch; the probe reads the group during the fit
        def on_fit_start(self, loop: object) -> None:
            seen.append((distributed.is_initialized(), distributed.world_size()))

    loop = make_loop([Probe()], train=_loader)
    loop.fit(1)
    assert not distributed.is_initialized()  # destroyed at the end of the clean fit
    loop.fit(2)  # a second group in the same process: its store keys are its own
    assert not distributed.is_initialized()
    assert seen == [(True, 1), (True, 1)]
    assert loop.state.step == 2 * len(loop.train_data)
    assert torch.isfinite(next(loop.model.parameters())).all()


def test_a_group_the_user_made_is_joined_and_left_alone(one_process_torchrun: None) -> None:
    dist.init_process_group("gloo")
    try:
        loop = make_loop([DDP()], train=_loader)
        loop.fit(1)
        assert distributed.is_initialized()  # not created by the launch: not destroyed
    finally:
        dist.destroy_process_group()
