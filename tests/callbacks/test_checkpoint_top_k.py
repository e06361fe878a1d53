"""Checkpoint(save_top_k, initial_value_threshold): which files remain, by a hand ranking."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hookloop import Callback, ConfigurationError, Loop
from hookloop.callbacks import Checkpoint

from builders import ScriptedMetric, regression_batches
from builders import make_loop as build_loop


class Scripted(ScriptedMetric):
    """val_score = values[epoch] at each validation; keeps the weights validated, by step."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(values, weights_by="step")


def make_loop(callbacks: list[Callback], batches: int = 2) -> Loop:
    return build_loop(callbacks, train=lambda: regression_batches(batches), val=slice(1))


def hand_top_k(values: list[float], k: int | None, mode: str,
               threshold: float | None = None) -> list[int]:
    """Indices (epochs) of the kept validations, best first: ties keep the earlier."""
    sign = -1.0 if mode == "max" else 1.0
    allowed = [i for i, v in enumerate(values) if threshold is None or sign * v < sign * threshold]
    ranked = sorted(allowed, key=lambda i: (sign * values[i], i))
    return ranked if k is None else ranked[:k]


def best_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("best-"))


VALUES = [0.5, 0.7, 0.6, 0.7, 0.9, 0.1, 0.9]  # ties at 0.7 and 0.9: the earlier is kept


@pytest.mark.parametrize("k", [2, 3, None])
@pytest.mark.parametrize("mode", ["max", "min"])
def test_the_k_best_files_remain(tmp_path: Path, k: int | None, mode: str) -> None:
    scripted = Scripted(VALUES)
    checkpoint = Checkpoint(tmp_path, monitor="val_score", mode=mode, save_top_k=k)
    make_loop([scripted, checkpoint]).fit(len(VALUES))
    kept = hand_top_k(VALUES, k, mode)
    steps = [2 * (epoch + 1) for epoch in kept]  # 2 batches per epoch
    assert [entry["step"] for entry in checkpoint.top_k] == steps
    expected = sorted(f"best-val_score={VALUES[e]:.6g}-step={2 * (e + 1):08d}.pt" for e in kept)
    assert best_files(tmp_path) == expected
    # The scores are readable from the names alone.
    assert sorted((value, step) for value, step, _ in checkpoint.files.scored()) == \
        sorted((VALUES[e], 2 * (e + 1)) for e in kept)
    # best.pt is the single best, and holds the weights validated at its step.
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["step"] == steps[0] and best["hookloop"]["value"] == VALUES[kept[0]]
    for name, value in scripted.weights_at[steps[0]].items():
        assert torch.equal(best["model"][name], value)
    for entry in checkpoint.top_k:  # each file holds the weights of its own validation
        payload = torch.load(tmp_path / entry["file"], weights_only=True)
        for name, value in scripted.weights_at[entry["step"]].items():
            assert torch.equal(payload["model"][name], value)


def test_top_1_keeps_only_best_pt(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, monitor="val_score", mode="max")
    make_loop([Scripted(VALUES), checkpoint]).fit(len(VALUES))
    assert best_files(tmp_path) == [] and (tmp_path / "best.pt").exists()
    assert [(e["value"], e["step"]) for e in checkpoint.top_k] == [(0.9, 10)]  # the earlier 0.9


@pytest.mark.parametrize("k", [1, 2])
def test_no_best_file_until_the_threshold_is_beaten(tmp_path: Path, k: int) -> None:
    values = [0.5, 0.75, 0.8, 0.6, 0.9]
    checkpoint = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=k,
                            initial_value_threshold=0.8)
    loop = make_loop([Scripted(values), checkpoint])
    loop.fit(3)  # 0.8 only equals the threshold: nothing
    assert not (tmp_path / "best.pt").exists() and best_files(tmp_path) == []
    assert checkpoint.best is None and checkpoint.top_k == []
    loop.fit(5)
    assert torch.load(tmp_path / "best.pt", weights_only=True)["step"] == 10
    assert [e["step"] for e in checkpoint.top_k] == [10]  # 0.9 only: 0.6 is below 0.8
    assert [2 * (e + 1) for e in hand_top_k(values, k, "max", threshold=0.8)] == [10]


def test_resume_keeps_the_top_k_list(tmp_path: Path) -> None:
    first = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=2)
    make_loop([Scripted(VALUES), first]).fit(4)
    assert [e["step"] for e in first.top_k] == [4, 8] or [e["step"] for e in first.top_k] == [4, 6]
    resumed = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=2, resume=True)
    make_loop([Scripted(VALUES), resumed]).fit(len(VALUES))
    assert resumed.top_k[0]["step"] == 10  # the 0.9 of epoch 4
    whole_dir = tmp_path / "whole"
    whole = Checkpoint(whole_dir, monitor="val_score", mode="max", save_top_k=2)
    make_loop([Scripted(VALUES), whole]).fit(len(VALUES))
    assert resumed.top_k == whole.top_k
    assert best_files(tmp_path) == best_files(whole_dir)


def test_a_rollback_retires_the_later_top_k_files(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=3, keep_last=None)
    make_loop([Scripted(VALUES), checkpoint]).fit(len(VALUES))
    # Hand ranking: 0.9 (step 10), 0.9 (step 14, a tie that still fits in 3), 0.7 (step 4).
    assert best_files(tmp_path) == ["best-val_score=0.7-step=00000004.pt",
                                    "best-val_score=0.9-step=00000010.pt",
                                    "best-val_score=0.9-step=00000014.pt"]
    resume_file = tmp_path / "epoch=0001-step=00000004.pt"
    branch = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=3,
                        keep_last=None, resume=str(resume_file))
    loop = make_loop([Scripted([0.0] * len(VALUES)), branch])
    with pytest.warns(RuntimeWarning, match="abandons"):
        loop.fit(2)  # the run was at epoch 2 of 2: nothing more to train; the files move
    # The later branch's files are moved away, never deleted.
    retired = tmp_path / "retired-after-step=00000004"
    assert {"best-val_score=0.9-step=00000010.pt", "best-val_score=0.9-step=00000014.pt",
            "best.pt"} <= set(os.listdir(retired))
    # At step 4 the list was [0.7 (step 4), 0.5 (step 2)]. The abandoned branch dropped the
    # step-2 file when 0.7 of step 8 entered, but set it aside while the rotating files of
    # steps 2 to 8 ranked it: the branch keeps both, as an uninterrupted run of it would.
    assert [e["step"] for e in branch.top_k] == [4, 2]
    assert best_files(tmp_path) == ["best-val_score=0.5-step=00000002.pt",
                                    "best-val_score=0.7-step=00000004.pt"]
    # best.pt is again the single best of this branch.
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["step"] == 4 and branch.best == 0.7 and branch.best_path == str(tmp_path / "best.pt")


def test_a_crash_before_the_first_rotating_file_keeps_the_ranking_from_the_names(
        tmp_path: Path) -> None:
    first = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=2, every_n_epochs=None)
    make_loop([Scripted(VALUES), first]).fit(4)  # no rotating file: every_n_epochs=None...
    for name in os.listdir(tmp_path):  # ...and the last-epoch file removed, as after a crash
        if name.startswith("epoch="):
            os.unlink(tmp_path / name)
    again = Checkpoint(tmp_path, monitor="val_score", mode="max", save_top_k=2, resume=True)
    make_loop([Scripted(VALUES), again]).fit(0)  # setup adopts the files; trains nothing
    assert [(e["value"], e["step"]) for e in again.top_k] == [(0.7, 4), (0.7, 8)]
    assert again.best == 0.7


@pytest.mark.parametrize("kwargs", [dict(save_top_k=0), dict(save_top_k=-1),
                                    dict(save_top_k=2.0), dict(initial_value_threshold="0.5"),
                                    dict(initial_value_threshold=float("nan"))])
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Checkpoint(tmp_path, monitor="val_loss", **kwargs)  # type: ignore[arg-type]


def test_ranking_options_need_a_monitor(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="save_top_k.*monitor"):
        Checkpoint(tmp_path, save_top_k=3)
    with pytest.raises(ConfigurationError, match="initial_value_threshold.*monitor"):
        Checkpoint(tmp_path, initial_value_threshold=0.5)
