"""The files a rollback abandons, moved away completely or not at all.

A rollback (``Checkpoint(resume=path)`` to a file older than the newest) makes the later
files of the run belong to an abandoned branch. They are moved, never deleted, into
``retired-after-step=SSSSSSSS/`` (``-2``, ``-3``... when that exists). The list of moves is
written first, as a marker file: a kill in the middle leaves it, and the next start
(`Retirement.finish`) does the moves not done yet before anything picks a file.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress

from hookloop.runfile.storage import fsync_directory, write_text_atomic

__all__ = ["RETIRED_PREFIX", "Retirement"]

#: Folder (in the checkpoint directory) of the files a rollback abandoned.
RETIRED_PREFIX = "retired-after-step="


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
        write_text_atomic(json.dumps({"into": target, "move": names}), self.marker)
        self.finish()
        return os.path.join(self.dirpath, target)

    def finish(self) -> bool:
        """Do the moves the marker lists (those not done yet), then remove it; True if any."""
        try:
            with open(self.marker, encoding="utf-8") as handle:
                plan = json.load(handle)
        except FileNotFoundError:
            return False
        target = os.path.join(self.dirpath, plan["into"])
        os.makedirs(target, exist_ok=True)
        for name in plan["move"]:
            with suppress(FileNotFoundError):  # moved before the kill
                os.replace(os.path.join(self.dirpath, name), os.path.join(target, name))
        fsync_directory(target)
        fsync_directory(self.dirpath)
        os.unlink(self.marker)
        return True
