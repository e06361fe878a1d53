"""Issue 33, items 1-2: nothing outside the run directory is touched, whatever a file planted
in it says. A rollback's journal (``rollback-in-progress.json``) that names a path outside
the directory, or a link, is refused by name before anything moves, at every start (a fresh
one and a resume); a lock file that is a symbolic link is refused, its target untouched.
The oracle is the file system itself: every file outside is byte-identical afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from hookloop import CheckpointError, Loop
from hookloop.callbacks import Checkpoint
from hookloop.runfile.directory_lock import LOCK_NAME

JOURNAL = "rollback-in-progress.json"


def _fit(directory: Path, resume: bool | str) -> Loop:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                loss_fn=nn.functional.mse_loss, device="cpu",
                callbacks=[Checkpoint(directory, resume=resume)])
    loop.fit(1)
    return loop


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (links as their target's text), with its bytes."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = os.readlink(path).encode()
        else:
            found[key] = path.read_bytes() if path.is_file() else None
    return found


def _plant(directory: Path, plan: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / JOURNAL).write_text(json.dumps(plan))


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_journal_moving_a_file_to_an_absolute_folder_is_refused_and_moves_nothing(
        tmp_path: Path, resume: bool) -> None:
    """``{"into": "/some/abs/dir", "move": ["zz-evil.pth"]}``: a .pth dropped into a
    site-packages-like folder would run at the next Python start."""
    run, site = tmp_path / "ckpt", tmp_path / "site-packages"
    site.mkdir()
    _plant(run, {"into": str(site), "move": ["zz-evil.pth"]})
    (run / "zz-evil.pth").write_text("import os; os.system('touch pwned')\n")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        _fit(run, resume)
    assert str(run / JOURNAL) in str(raised.value)
    assert "nothing moved" in str(raised.value) and "delete it" in str(raised.value)
    assert _tree(tmp_path) == before  # the .pth stays where it was planted; site is empty
    assert list(site.iterdir()) == []


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_journal_pulling_a_file_from_outside_is_refused_and_moves_nothing(
        tmp_path: Path, resume: bool) -> None:
    """``{"into": "loot", "move": ["../secret.txt"]}`` would take a file from outside into
    the directory and remove it from its place."""
    run = tmp_path / "ckpt"
    (tmp_path / "secret.txt").write_text("api key")
    _plant(run, {"into": "loot", "move": ["../secret.txt"]})
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="rollback-in-progress.json: refused"):
        _fit(run, resume)
    assert _tree(tmp_path) == before and (tmp_path / "secret.txt").read_text() == "api key"
    assert not (run / "loot").exists()


@pytest.mark.parametrize("plan, named", [
    ({"into": "retired-after-step=00000001", "move": ["../secret.txt"]}, "'../secret.txt'"),
    ({"into": "retired-after-step=00000001", "move": [str(Path("/tmp/x.pt"))]}, "/tmp/x.pt"),
    ({"into": "retired-after-step=00000001", "move": [".."]}, "'..'"),
    ({"into": "retired-after-step=00000001", "move": ["linked.pt"]}, "symbolic link"),
    ({"into": "retired-after-step=00000001/..", "move": ["epoch.pt"]}, "separator"),
    ({"into": "../retired-after-step=00000001", "move": ["epoch.pt"]}, "separator"),
    ({"into": "outlet", "move": ["epoch.pt"]}, "'outlet' does not name a retirement folder"),
    ({"into": "retired-after-step=00000002", "move": ["epoch.pt"]}, "a link or a file"),
    ({"into": 5, "move": ["epoch.pt"]}, "5 is not a file name"),
    ({"into": "retired-after-step=00000001", "move": "epoch.pt"}, "a 'move' list"),
    ([1, 2], "a 'move' list"),
], ids=["dotdot", "absolute", "parent", "link", "into-parent", "into-outside",
        "into-other", "into-link", "into-number", "move-string", "not-a-plan"])
def test_every_name_of_a_journal_must_be_a_plain_entry_of_the_directory(
        tmp_path: Path, plan: object, named: str) -> None:
    run, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "secret.txt").write_text("secret")
    _plant(run, plan)
    (run / "epoch.pt").write_bytes(b"weights")
    (run / "linked.pt").symlink_to(tmp_path / "secret.txt")
    (run / "retired-after-step=00000002").symlink_to(outside, target_is_directory=True)
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        _fit(run, False)
    assert str(run / JOURNAL) in str(raised.value) and named in str(raised.value)
    assert _tree(tmp_path) == before


def test_a_journal_that_is_a_link_or_not_json_is_refused_by_name(tmp_path: Path) -> None:
    run = tmp_path / "ckpt"
    run.mkdir()
    elsewhere = tmp_path / "plan.json"
    elsewhere.write_text(json.dumps({"into": "retired-after-step=00000001", "move": ["a.pt"]}))
    (run / JOURNAL).symlink_to(elsewhere)
    (run / "a.pt").write_bytes(b"a")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="cannot be read as a plain file"):
        _fit(run, False)
    assert _tree(tmp_path) == before
    (run / JOURNAL).unlink()
    (run / JOURNAL).write_text("{not json")
    with pytest.raises(CheckpointError, match="not the JSON a rollback writes"):
        _fit(run, False)


def test_a_refused_journal_then_removed_lets_the_run_start(tmp_path: Path) -> None:
    """The message's fix works, in the same process: the directory was released."""
    run = tmp_path / "ckpt"
    _plant(run, {"into": "loot", "move": ["../x"]})
    with pytest.raises(CheckpointError):
        _fit(run, False)
    (run / JOURNAL).unlink()
    assert _fit(run, False).state.step == 3


def test_a_journal_a_killed_rollback_left_is_still_finished(tmp_path: Path) -> None:
    """The journal hookloop writes (plain names into a retirement folder, some moved
    before the kill) is finished at the next start, as before."""
    run = tmp_path / "ckpt"
    _plant(run, {"into": "retired-after-step=00000003",
                 "move": ["epoch=0000-step=00000006.pt", "epoch=0000-step=00000009.pt"]})
    (run / "retired-after-step=00000003").mkdir()
    (run / "retired-after-step=00000003" / "epoch=0000-step=00000006.pt").write_bytes(b"6")
    (run / "epoch=0000-step=00000009.pt").write_bytes(b"9")
    with pytest.warns(RuntimeWarning, match="finished the rollback"):
        _fit(run, False)
    assert sorted(os.listdir(run / "retired-after-step=00000003")) == [
        "epoch=0000-step=00000006.pt", "epoch=0000-step=00000009.pt"]
    assert not (run / JOURNAL).exists()


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(
        tmp_path: Path, resume: bool) -> None:
    run, target = tmp_path / "ckpt", tmp_path / "precious.txt"
    run.mkdir()
    target.write_bytes(b"a user's file\n" * 10)
    (run / LOCK_NAME).symlink_to(target)
    with pytest.raises(CheckpointError) as raised:
        _fit(run, resume)
    assert str(run / LOCK_NAME) in str(raised.value) and "symbolic link" in str(raised.value)
    assert target.read_bytes() == b"a user's file\n" * 10
    assert (run / LOCK_NAME).is_symlink()  # left for the user to look at
    dangling = tmp_path / "ckpt2"
    dangling.mkdir()
    (dangling / LOCK_NAME).symlink_to(tmp_path / "created-by-the-link")
    with pytest.raises(CheckpointError, match="symbolic link"):
        _fit(dangling, resume)
    assert not (tmp_path / "created-by-the-link").exists()


@pytest.mark.parametrize("name", [".hookloop.lock", ".tmp-1234.part"])
def test_a_journal_may_not_move_the_lock_or_a_save_in_progress(tmp_path: Path,
                                                               name: str) -> None:
    """Moving the held lock away would let a second job take a fresh one: two jobs in one
    directory (found in review)."""
    run = tmp_path / "ckpt"
    _plant(run, {"into": "retired-after-step=00000001", "move": [name]})
    with pytest.raises(CheckpointError, match="the lock or a save in progress"):
        _fit(run, False)
    assert not (run / "retired-after-step=00000001").exists()


@pytest.mark.parametrize("text", ["[" * 200_000, json.dumps(
    {"into": "retired-after-step=00000001\n", "move": ["a.pt"]})], ids=["deep", "newline"])
def test_a_journal_nested_past_the_limit_or_naming_a_newline_is_refused(
        tmp_path: Path, text: str) -> None:
    run = tmp_path / "ckpt"
    run.mkdir()
    (run / JOURNAL).write_text(text)
    (run / "a.pt").write_bytes(b"a")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="rollback-in-progress.json: refused"):
        _fit(run, False)
    assert _tree(tmp_path) == before


def test_a_lock_file_hard_linked_to_another_file_is_refused(tmp_path: Path) -> None:
    """Where the kernel allows hard links to another user's file (fs.protected_hardlinks=0),
    a lock file linked to it would be truncated: a second name of a file is refused."""
    run, target = tmp_path / "ckpt", tmp_path / "precious.txt"
    run.mkdir()
    target.write_bytes(b"keep me\n")
    os.link(target, run / LOCK_NAME)
    with pytest.raises(CheckpointError, match="a hard link to another file"):
        _fit(run, False)
    assert target.read_bytes() == b"keep me\n"
