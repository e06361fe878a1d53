"""The W&B offline file's artifact records as `WandbLogger` reads them (to skip, at a relaunch,
the uploads a killed launch's file kept) against W&B's own reader (``wandb leet inspect
--json``): a file of several 32 KiB blocks, whole and cut at a block boundary as a SIGKILL
leaves it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hookloop.callbacks import Checkpoint, WandbLogger
from hookloop.callbacks.wandb_logger import _artifact_aliases

from conftest import console_script, subprocess_env

pytest.importorskip("wandb")
BLOCK = 32768


def inspected(path: Path) -> set[str]:
    read = subprocess.run([console_script("wandb"), "leet", "inspect", "--json", str(path)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr
    aliases: set[str] = set()
    for line in read.stdout.splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("type") == "artifact":
            aliases.update(record["artifact"]["aliases"])
    return aliases


@pytest.mark.slow
def test_artifact_aliases_match_wandbs_reader_whole_and_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    from hookloop import Loop

    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(1)]
    tracker = WandbLogger("p", dir=tmp_path, mode="offline", every_n_steps=1000,
                          log_checkpoints="all")
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data, val_data=data[:1],
         loss_fn=nn.functional.mse_loss, device="cpu",
         callbacks=[tracker, Checkpoint(tmp_path / "ckpt", monitor="val_loss")]).fit(120)
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    size = path.stat().st_size
    assert size > 3 * BLOCK  # artifact records cross blocks (in wandb 0.31, 5 are in pieces)
    whole = inspected(path)
    assert len([alias for alias in whole if alias.startswith("step=")]) == 120
    assert _artifact_aliases(str(path)) == whole
    cut = tmp_path / "cut.wandb"
    with open(path, "rb") as source, open(cut, "wb") as target:
        target.write(source.read((size // BLOCK - 1) * BLOCK))
    kept = inspected(cut)
    assert 0 < len(kept) < len(whole)
    assert _artifact_aliases(str(cut)) == kept
    shutil.rmtree(tmp_path / "wandb")
