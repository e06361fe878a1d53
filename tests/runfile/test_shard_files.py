"""hookloop.runfile.shard_files: what a sharded checkpoint directory holds where, and that a
directory is complete or absent whatever a kill interrupts (a replacement, a deletion, a
save); and hookloop.runfile.sharded's promise that ``import hookloop`` imports none of torch's
distributed tensor, FSDP or checkpoint packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env

from hookloop.runfile import shard_files
from hookloop.runfile.checkpoint_files import CheckpointFiles


def _complete(path: Path, label: str) -> Path:
    """A directory that passes for a complete sharded checkpoint, marked with ``label``."""
    path.mkdir()
    (path / ".metadata").write_text(label)
    (path / shard_files.PLAIN_FILE).write_text(label)
    return path


def test_the_plain_part_keeps_everything_but_tensors_of_model_optimizer_and_shards() -> None:
    payload = {"hookloop": {"kind": "resume"}, "loop": {"step": 3},
               "model": {"w": torch.ones(2)},
               "optimizer": {"state": {"w": {"exp_avg": torch.zeros(2)}},
                             "param_groups": [{"lr": 0.1, "params": ["w"]}]},
               "callbacks": {"EMA": {"updates": 4, "shadow": {"w": torch.ones(2)}}}}
    plain, tensors = shard_files.split_shards(payload)
    assert plain["model"] == {} and plain["optimizer"]["state"] == {}
    assert plain["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    assert plain["loop"] == {"step": 3} and plain["hookloop"] == {"kind": "resume"}
    assert torch.equal(tensors["model"]["w"], torch.ones(2))
    assert torch.equal(tensors["optimizer"]["state"]["w"]["exp_avg"], torch.zeros(2))
    # Plain tensors of callbacks stay in the plain part; only DTensors become markers.
    assert torch.equal(plain["callbacks"]["EMA"]["shadow"]["w"], torch.ones(2))
    assert "callbacks" not in tensors


def test_a_kill_between_the_two_renames_of_a_replacement_is_undone_at_the_next_start(
        tmp_path: Path) -> None:
    old = _complete(tmp_path / "best.dcp", "old")
    new = _complete(tmp_path / ".tmp-new.part", "new")
    real_replace = os.replace
    calls = []

    def killed_after_the_first(source: str, target: str) -> None:
        calls.append(source)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies here: best.dcp is set aside
        real_replace(source, target)

    os.replace = killed_after_the_first  # type: ignore[assignment]
    try:
        shard_files.install_directory(str(new), str(old))
    except KeyboardInterrupt:
        pass
    finally:
        os.replace = real_replace  # type: ignore[assignment]
    assert not old.exists()
    files = CheckpointFiles(str(tmp_path))
    files.prepare()  # the next start
    files.release()
    assert (tmp_path / "best.dcp" / ".metadata").read_text() == "old"
    # The new directory, never put in place, is deleted like any killed save's.
    assert [name for name in sorted(os.listdir(tmp_path)) if name != ".hookloop.lock"] == [
        "best.dcp"]


def test_a_replacement_and_a_removal_leave_complete_directories_only(tmp_path: Path) -> None:
    old = _complete(tmp_path / "best.dcp", "old")
    shard_files.install_directory(str(_complete(tmp_path / ".tmp-new.part", "new")), str(old))
    assert (old / ".metadata").read_text() == "new"
    shard_files.link_directory(str(old), str(tmp_path / "copy.dcp"))
    assert (tmp_path / "copy.dcp" / ".metadata").read_text() == "new"
    shard_files.remove_entry(str(old))
    assert sorted(os.listdir(tmp_path)) == ["copy.dcp"]  # renamed away first, then deleted


def test_rotating_lists_directories_beside_files_by_step_and_never_a_temporary(
        tmp_path: Path) -> None:
    files = CheckpointFiles(str(tmp_path))
    files.write({"model": {"w": torch.ones(1)}}, "epoch=0000-step=00000002.pt")
    _complete(tmp_path / "epoch=0000-step=00000004.dcp", "a")
    # No metadata under a final name: a damaged copy, listed (as a damaged file is), so that
    # resuming refuses it by name instead of skipping it silently.
    (tmp_path / "epoch=0001-step=00000006.dcp").mkdir()
    _complete(tmp_path / ".tmp-abc.part", "killed save")
    assert [os.path.basename(path) for path in files.rotating()] == [
        "epoch=0000-step=00000002.pt", "epoch=0000-step=00000004.dcp",
        "epoch=0001-step=00000006.dcp"]


@pytest.mark.slow
def test_import_hookloop_imports_no_distributed_tensor_fsdp_or_checkpoint() -> None:
    heavy = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
    code = ("import json, sys, hookloop, hookloop.callbacks; "
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
