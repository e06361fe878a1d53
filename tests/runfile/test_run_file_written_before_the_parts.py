"""A checkpoint written before the run's state became a set of parts resumes exactly, or is
refused by name (issue 34's "done when": "a checkpoint written by today's release"). The
files under ``before_parts/`` were written by the tree that issue was filed against
(commit dc71d7f) with ``before_parts/before_parts_run.py``, whose docstring says how.

The oracle is that tree's own uninterrupted run of the same stack, compared bit for bit
where this machine computes as the one that wrote it (the same torch, the same CPU
kernels: the file's first 8 steps were computed there). Elsewhere floats round otherwise
after the resume, so the comparison is within 1e-4 (relative); the other resume tests
prove bit-exactness against runs of this machine."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import hookloop
from hookloop import Callback, CheckpointError, Loop

BEFORE = Path(__file__).parent / "before_parts"
_spec = importlib.util.spec_from_file_location("before_parts_run", BEFORE / "before_parts_run.py")
assert _spec is not None and _spec.loader is not None
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


class Batches(Callback):
    """The batches this process trains (no state: a resumed fit counts from zero)."""

    def __init__(self) -> None:
        self.trained = 0

    def on_batch_end(self, loop: Loop) -> None:
        self.trained += 1


def _checkpoints(tmp_path: Path) -> Path:
    directory = tmp_path / "checkpoints"
    shutil.copytree(BEFORE / "checkpoints", directory)
    return directory


def _assert_same(ended: Any, oracle: Any, *, exact: bool = True) -> None:
    """Tensors, numbers and the dicts and lists of them: equal, or within 1e-4 relative."""
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-4, "atol": 1e-6}
    torch.testing.assert_close(ended, oracle, **tolerance)


def test_a_mid_epoch_checkpoint_written_before_the_parts_resumes_into_its_uninterrupted_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _checkpoints(tmp_path)
    batches = Batches()
    loop, ema, counter = run.build(directory, resume=True, extra=(batches,))
    loop.fit(run.EPOCHS)
    newest = directory / f"epoch=0001-step={run.SNAPSHOT_STEP:08d}.pt"
    assert f"resumed from {newest}" in capsys.readouterr().out
    assert batches.trained == 6 * run.EPOCHS - run.SNAPSHOT_STEP  # from the file's position
    resumed = run.outcome(loop, ema, counter)
    oracle = torch.load(BEFORE / "oracle.pt", weights_only=True)
    _assert_same(resumed, oracle, exact=oracle.pop("machine") == run.machine())


def test_a_best_file_written_before_the_parts_loads_its_weights(tmp_path: Path) -> None:
    loop, _, _ = run.build(tmp_path / "unused", resume=False)
    hookloop.load_checkpoint(BEFORE / "checkpoints" / "best.pt", loop.model)
    saved = torch.load(BEFORE / "checkpoints" / "best.pt", weights_only=True)["model"]
    _assert_same(loop.model.state_dict(), saved)


def test_a_checkpoint_written_before_the_parts_is_refused_by_name_by_another_model(
        tmp_path: Path) -> None:
    """Another width: refused at the fit's setup, naming the file and the first tensor that
    differs, as docs/when-things-go-wrong.md says; no batch trains, no file changes."""
    directory = _checkpoints(tmp_path)
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    batches = Batches()
    loop, _, _ = run.build(directory, resume=True, extra=(batches,), hidden=8)
    with pytest.raises(CheckpointError, match="wrong architecture") as raised:
        loop.fit(run.EPOCHS)
    assert f"epoch=0001-step={run.SNAPSHOT_STEP:08d}.pt" in str(raised.value)
    assert "'0.weight': saved (16, 4), the model's (8, 4)" in str(raised.value)
    assert batches.trained == 0
    assert {path.name: path.read_bytes() for path in directory.iterdir()
            if path.name != ".hookloop.lock"} == before
