"""The files a rollback abandons, moved away completely or not at all.

A rollback (``Checkpoint(resume=path)`` to a file older than the newest) makes the later
files of the run belong to an abandoned branch. They are moved, never deleted, into
``retired-after-step=SSSSSSSS/`` (``-2``, ``-3``... when that exists). The list of moves is
written first, as a marker file: a kill in the middle leaves it, and the next start
(`Retirement.finish`) does the moves not done yet before anything picks a file.

The marker is a file of the run directory, so it is read as input anyone may have planted:
before anything moves, every name it holds must be a plain entry of the directory (no
separator, no ``..``, not absolute, not a symbolic link) and the folder it moves into a
retirement folder of the directory; anything else is refused by name, nothing moved.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import suppress
from typing import Any

from hookloop.errors import CheckpointError
from hookloop.runfile.directory_lock import LOCK_NAME
from hookloop.runfile.storage import (
    entry_problem,
    fsync_directory,
    is_temporary,
    read_own_text,
    write_text_atomic,
)

__all__ = ["RETIRED_PREFIX", "Retirement"]

#: Folder (in the checkpoint directory) of the files a rollback abandoned.
RETIRED_PREFIX = "retired-after-step="
_RETIRED = re.compile(rf"{re.escape(RETIRED_PREFIX)}\d{{8,}}(?:-\d+)?")  # fullmatch


class Retirement:
    """The moves of one `Checkpoint`'s rollbacks in ``dirpath``, planned in ``marker``.

    Example:
        >>> import os, tempfile
        >>> directory = tempfile.mkdtemp()
        >>> open(os.path.join(directory, "later.pt"), "wb").close()
        >>> retirement = Retirement(directory, os.path.join(directory, "rollback.json"))
        >>> os.path.basename(retirement.retire([os.path.join(directory, "later.pt")], 3))
        'retired-after-step=00000003'
        >>> sorted(os.listdir(directory))
        ['retired-after-step=00000003']
    """

    def __init__(self, dirpath: str, marker: str) -> None:
        self.dirpath = dirpath
        self.marker = marker

    def retire(self, later: list[str], step: int) -> str:
        """Move the files ``later`` (a rollback to ``step``) into a new retirement folder;
        return its path."""
        target = f"{RETIRED_PREFIX}{step:08d}"
        suffix = 1
        while os.path.exists(os.path.join(self.dirpath, target)):
            suffix += 1
            target = f"{RETIRED_PREFIX}{step:08d}-{suffix}"
        names = [os.path.basename(path) for path in later]
        self._check({"into": target, "move": names})  # the same rule as a planted marker's
        write_text_atomic(json.dumps({"into": target, "move": names}), self.marker)
        self.finish()
        return os.path.join(self.dirpath, target)

    def finish(self) -> bool:
        """Do the moves the marker lists (those not done yet), then remove it; True if any.

        Raises:
            CheckpointError: the marker is not one `retire` writes (a symbolic link, a name
                outside the directory, a folder that is not a retirement folder): naming
                it, before anything moves.
        """
        try:
            text = read_own_text(self.marker)
        except FileNotFoundError:
            return False
        except (OSError, UnicodeDecodeError) as error:
            raise self._refused(f"it cannot be read as a plain file ({error})") from None
        try:
            plan = json.loads(text)
        except (ValueError, RecursionError) as error:  # a planted file nested past Python's limit
            raise self._refused(f"it is not the JSON a rollback writes ({error})") from None
        self._check(plan)
        target = os.path.join(self.dirpath, plan["into"])
        os.makedirs(target, exist_ok=True)
        for name in plan["move"]:
            with suppress(FileNotFoundError):  # moved before the kill
                os.replace(os.path.join(self.dirpath, name), os.path.join(target, name))
        fsync_directory(target)
        fsync_directory(self.dirpath)
        os.unlink(self.marker)
        return True

    def _check(self, plan: Any) -> None:
        """Refuse a plan that would move anything outside the directory, or move a link."""
        if not isinstance(plan, dict) or not isinstance(plan.get("move"), list):
            raise self._refused("it is not a rollback's plan ('into' and a 'move' list)")
        into = plan.get("into")
        problem = entry_problem(into)
        if problem is None and not _RETIRED.fullmatch(str(into)):
            problem = f"{into!r} does not name a retirement folder ({RETIRED_PREFIX}...)"
        folder = os.path.join(self.dirpath, str(into)) if problem is None else ""
        if folder and (os.path.islink(folder)
                       or (os.path.lexists(folder) and not os.path.isdir(folder))):
            problem = f"{into!r} is not a folder of the directory (a link or a file)"
        for name in plan["move"] if problem is None else ():
            problem = entry_problem(name)
            if problem is None and os.path.islink(os.path.join(self.dirpath, name)):
                problem = f"{name!r} is a symbolic link"
            if problem is None and (name in (os.path.basename(self.marker), into, LOCK_NAME)
                                    or is_temporary(name)):
                problem = f"{name!r} is the plan, its folder, the lock or a save in progress"
            if problem:
                break
        if problem:
            raise self._refused(f"{problem}; a rollback only moves entries of {self.dirpath} "
                                f"into a new {RETIRED_PREFIX}... folder of it")

    def _refused(self, why: str) -> CheckpointError:
        return CheckpointError(
            f"{self.marker}: refused, nothing moved: {why}. hookloop writes this journal only "
            "while a rollback moves a run's later files; this one was edited or planted. "
            "Look at it, then delete it (and move any files yourself) to start.")
