"""A checkpoint whose fields hold the wrong type is refused by file and field, not converted
(issue 16, item 7): int64 weights into a float model, a text world_size, and every other
field of the loop's part, the file's own fields and the saved generators."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookloop import CheckpointError, Loop
import hookloop
from hookloop.callbacks import Checkpoint
from hookloop.runfile.format import read_payload

RESUME_FILE = "epoch=0001-step=00000004.pt"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def make_loop(directory: Path, resume: bool | str = False) -> Loop:
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(2)]
    model = make_model()
    return Loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data,
                val_data=data, loss_fn=F.mse_loss, device="cpu",
                callbacks=[Checkpoint(directory, monitor="val_loss", resume=resume)])


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("run")
    make_loop(directory).fit(2)
    assert sorted(os.listdir(directory)) == ["best.pt", RESUME_FILE]
    return directory


def edited(written: Path, tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None]
           ) -> Path:
    """A copy of the run's directory whose file ``name`` was changed by ``edit``."""
    directory = tmp_path / "run"
    directory.mkdir()
    for entry in os.listdir(written):
        (directory / entry).write_bytes((written / entry).read_bytes())
    payload = torch.load(directory / name, weights_only=True)
    edit(payload)
    torch.save(payload, directory / name)
    return directory


def as_dtype(dtype: torch.dtype, key: str = "0.weight") -> Callable[[dict[str, Any]], None]:
    def edit(payload: dict[str, Any]) -> None:
        payload["model"][key] = payload["model"][key].to(dtype)
    return edit


@pytest.mark.parametrize(("dtype", "key", "kinds"), [
    (torch.int64, "0.weight", "an integer tensor does not load into a floating-point one"),
    (torch.bool, "2.bias", "a bool tensor does not load into a floating-point one"),
    (torch.float32, "1.num_batches_tracked",
     "a floating-point tensor does not load into an integer one"),
])
def test_weights_of_another_kind_are_refused_on_resume(written: Path, tmp_path: Path,
                                                       dtype: torch.dtype, key: str,
                                                       kinds: str) -> None:
    directory = edited(written, tmp_path, RESUME_FILE, as_dtype(dtype, key))
    loop = make_loop(directory, resume=True)
    with pytest.raises(CheckpointError) as caught:
        loop.fit(3)
    message = str(caught.value)
    assert str(directory / RESUME_FILE) in message
    assert f"'model.{key}' holds {dtype}" in message and kinds in message
    assert loop.state.step == 0  # refused before anything was loaded or trained


def test_weights_of_another_kind_are_refused_by_load_checkpoint(written: Path,
                                                                tmp_path: Path) -> None:
    directory = edited(written, tmp_path, "best.pt", as_dtype(torch.int64))
    model = make_model()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"best\.pt: the checkpoint's field "
                                              r"'model\.0\.weight' holds torch\.int64"):
        hookloop.load_checkpoint(directory / "best.pt", model)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_another_floating_dtype_is_converted_with_a_warning(written: Path, tmp_path: Path
                                                            ) -> None:
    directory = edited(written, tmp_path, "best.pt", as_dtype(torch.float64))
    saved = torch.load(directory / "best.pt", weights_only=True)["model"]["0.weight"]
    model = make_model()
    with pytest.warns(RuntimeWarning, match=r"1 weight\(s\) were saved in another "
                                            r"floating-point dtype.*'model\.0\.weight' "
                                            r"\(torch\.float64 into torch\.float32\)"):
        hookloop.load_checkpoint(directory / "best.pt", model)
    assert model[0].weight.dtype == torch.float32
    assert torch.equal(model[0].weight, saved.to(torch.float32))


def test_an_unedited_file_loads_without_a_warning(written: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hookloop.load_checkpoint(written / RESUME_FILE, make_model())


def _set(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(payload: dict[str, Any]) -> None:
        holder = payload
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = value
    return edit


FIELDS = [
    ("loop.world_size", _set("loop", "world_size", value="1")),
    ("loop.world_size", _set("loop", "world_size", value=0)),
    ("loop.epochs", _set("loop", "epochs", value="2")),
    ("loop.max_steps", _set("loop", "max_steps", value=2.5)),
    ("loop.validated", _set("loop", "validated", value="no")),
    ("loop.optimizer_class", _set("loop", "optimizer_class", value=3)),
    ("loop.param_groups", _set("loop", "param_groups", value=["6"])),
    ("loop.history", _set("loop", "history", value={"epoch": 0})),
    ("loop.history[0]", _set("loop", "history", 0, value=[1, 2])),
    ("loop.history[0].step", _set("loop", "history", 0, "step", value="2")),
    ("loop.history[1].epoch", _set("loop", "history", 1, "epoch", value=1.0)),
    ("loop.history[0].val_loss", _set("loop", "history", 0, "val_loss", value="0.5")),
    ("loop.ended", _set("loop", "ended", value="all epochs done")),
    ("loop.ended.epochs", _set("loop", "ended", "epochs", value="2")),
    ("loop.ended.max_steps", _set("loop", "ended", "max_steps", value="4")),
    ("loop.ended.reason", _set("loop", "ended", "reason", value=None)),
    ("loop.batch_idx", _set("loop", "batch_idx", value=1.0)),
    ("ranks", _set("ranks", value={"0": {}})),
    ("ranks", _set("ranks", value=None)),
    ("ranks[0].train_samples", _set("ranks", 0, "train_samples", value="8")),
    ("ranks[0].rng.generators", _set("ranks", 0, "rng", "generators", value="abc")),
    ("ranks[0].rng.python[1]", _set("ranks", 0, "rng", "python", 1, value="state")),
    ("ranks[0].rng.python[2]", _set("ranks", 0, "rng", "python", 2, value="0.5")),
    ("ranks[0].rng.numpy[1]", _set("ranks", 0, "rng", "numpy", 1, value=[1, 2])),
    ("ranks[0].rng.numpy[2]", _set("ranks", 0, "rng", "numpy", 2, value="624")),
    ("hookloop.world_size", _set("hookloop", "world_size", value="1")),
    ("hookloop.step", _set("hookloop", "step", value="4")),
    ("hookloop.version", _set("hookloop", "version", value=1)),
]


@pytest.mark.parametrize(("field", "edit"), FIELDS, ids=[f"{field}-{index}" for index, (field, _)
                                                         in enumerate(FIELDS)])
def test_a_loop_field_of_the_wrong_type_is_refused_by_name(written: Path, tmp_path: Path,
                                                           field: str,
                                                           edit: Callable[[dict[str, Any]], None]
                                                           ) -> None:
    directory = edited(written, tmp_path, RESUME_FILE, edit)
    with pytest.raises(CheckpointError, match=f"the checkpoint's field {re.escape(repr(field))} "
                                              "is .*, expected"):
        read_payload(directory / RESUME_FILE, "cpu")


BEST_FIELDS = [
    ("hookloop.value", _set("hookloop", "value", value="0.25")),
    ("hookloop.monitor", _set("hookloop", "monitor", value=["val_loss"])),
    ("epoch", _set("epoch", value="1")),
    ("step", _set("step", value=-1)),
]


@pytest.mark.parametrize(("field", "edit"), BEST_FIELDS, ids=[field for field, _ in BEST_FIELDS])
def test_a_field_of_best_pt_of_the_wrong_type_is_refused_by_name(
        written: Path, tmp_path: Path, field: str, edit: Callable[[dict[str, Any]], None]) -> None:
    directory = edited(written, tmp_path, "best.pt", edit)
    pattern = f"the checkpoint's field {re.escape(repr(field))} is"
    with pytest.raises(CheckpointError, match=pattern):
        hookloop.load_checkpoint(directory / "best.pt", make_model())


def test_a_text_world_size_is_refused_when_resuming(written: Path, tmp_path: Path) -> None:
    directory = edited(written, tmp_path, RESUME_FILE, _set("loop", "world_size", value="1"))
    with pytest.raises(CheckpointError, match=r"epoch=0001-step=00000004\.pt: the checkpoint's "
                                              r"field 'loop\.world_size' is str \('1'\)"):
        make_loop(directory, resume=True).fit(3)


def test_the_written_files_pass_every_check(written: Path) -> None:
    """The oracle for the edits above: the files as written load, with the types checked."""
    for name in (RESUME_FILE, "best.pt"):
        read_payload(written / name, "cpu")
    loop = make_loop(written, resume=True)
    assert loop.fit(3).step == 6
