"""A checkpoint written by the release resumes exactly, or is refused by name (issue 34's
"done when"): the files under ``release_0_1/`` were written by hookloop 0.1.0, the release
before the run's state became a set of parts, with ``release_0_1/release_run.py`` (its docstring
says how). The oracle is that release's own uninterrupted run of the same stack."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from hookloop import Callback, CheckpointError, Loop

sys.path.insert(0, str(Path(__file__).parent / "release_0_1"))
from release_run import EPOCHS, SNAPSHOT_STEP, build, outcome  # noqa: E402

RELEASE = Path(__file__).parent / "release_0_1"


class Batches(Callback):
    """The batches this process trains (no state: a resumed fit counts from zero)."""

    def __init__(self) -> None:
        self.trained = 0

    def on_batch_end(self, loop: Loop) -> None:
        self.trained += 1


def _release_checkpoints(tmp_path: Path) -> Path:
    directory = tmp_path / "checkpoints"
    shutil.copytree(RELEASE / "checkpoints", directory)
    return directory


def _assert_same(ended: object, oracle: object, where: str = "") -> None:
    if isinstance(oracle, torch.Tensor):
        assert isinstance(ended, torch.Tensor) and torch.equal(ended, oracle), where
    elif isinstance(oracle, dict):
        assert isinstance(ended, dict) and sorted(ended) == sorted(oracle), where
        for key in oracle:
            _assert_same(ended[key], oracle[key], f"{where}.{key}")
    elif isinstance(oracle, list):
        assert isinstance(ended, list) and len(ended) == len(oracle), where
        for index, (mine, theirs) in enumerate(zip(ended, oracle)):
            _assert_same(mine, theirs, f"{where}[{index}]")
    else:
        assert ended == oracle, where


def test_a_mid_epoch_checkpoint_of_the_release_resumes_into_its_uninterrupted_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _release_checkpoints(tmp_path)
    batches = Batches()
    loop, ema, counter = build(directory, resume=True, extra=(batches,))
    loop.fit(EPOCHS)
    newest = directory / f"epoch=0001-step={SNAPSHOT_STEP:08d}.pt"
    assert f"resumed from {newest}" in capsys.readouterr().out
    assert batches.trained == 6 * EPOCHS - SNAPSHOT_STEP  # from the release's position on
    oracle = torch.load(RELEASE / "oracle.pt", weights_only=True)
    _assert_same(outcome(loop, ema, counter), oracle)


def test_the_release_s_best_file_loads_its_weights(tmp_path: Path) -> None:
    """best.pt of the release: `hookloop.load_checkpoint` puts its weights into the model."""
    import hookloop
    loop, _, _ = build(tmp_path / "unused", resume=False)
    hookloop.load_checkpoint(RELEASE / "checkpoints" / "best.pt", loop.model)
    saved = torch.load(RELEASE / "checkpoints" / "best.pt", weights_only=True)["model"]
    _assert_same(loop.model.state_dict(), saved)


def test_the_release_s_checkpoint_is_refused_by_name_by_another_model(tmp_path: Path) -> None:
    """Another width: refused before the first batch, naming the file and the first tensor
    that differs, as docs/when-things-go-wrong.md says; the files are left as they were."""
    directory = _release_checkpoints(tmp_path)
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    loop, _, _ = build(directory, resume=True, hidden=8)
    with pytest.raises(CheckpointError, match="wrong architecture") as raised:
        loop.fit(EPOCHS)
    assert f"epoch=0001-step={SNAPSHOT_STEP:08d}.pt" in str(raised.value)
    assert "'0.weight': saved (16, 4), the model's (8, 4)" in str(raised.value)
    assert {path.name: path.read_bytes() for path in directory.iterdir()
            if path.name != ".hookloop.lock"} == before
