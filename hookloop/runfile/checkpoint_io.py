"""What the `hookloop.callbacks.Checkpoint` callback builds on, in one place: the files of
its directory (`hookloop.runfile.checkpoint_files`: names, atomic writes, integrity, retirement),
the background writes (`hookloop.runfile.background_save`), the clock of timed saves
(`hookloop.parallel.suspension`), the ranking of the best validations (`hookloop.runfile.ranking`), the
model's state as saved (`hookloop.runfile.sharded`), the finiteness check (`hookloop.runfile.weights`),
`load_checkpoint` (`hookloop.runfile.loading`) and the keys of the file it reads (`hookloop.runfile.format`);
`resumable` picks the file to resume, none when another callback restored the run.

The callback keeps the policy (when to save, which files to keep, which to resume); the IO
and the integrity live below it, reached through this module only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hookloop.parallel.suspension import TimedSaves
from hookloop.runfile.background_save import RotatingWrites
from hookloop.runfile.checkpoint_files import CheckpointFiles
from hookloop.runfile.format import MODEL, VALUE
from hookloop.runfile.loading import load_checkpoint
from hookloop.runfile.ranking import TopK
from hookloop.runfile.sharded import model_state
from hookloop.runfile.weights import all_finite

__all__ = ["CheckpointFiles", "MODEL", "RotatingWrites", "TimedSaves", "TopK", "VALUE",
           "all_finite", "load_checkpoint", "model_state", "resumable"]


def resumable(files: Sequence[str], callbacks: Iterable[object], dirpath: str) -> str | None:
    """The file ``Checkpoint(resume=True)`` resumes: the newest of ``files``; None when
    there is none, or when a callback's setup restored the whole run (its ``restored_run``
    names the source: ``FaultTolerance``'s live peer, whose state is newer than any file
    of ``dirpath``; said once)."""
    for callback in callbacks:
        source = getattr(callback, "restored_run", None)
        if isinstance(source, str):
            print(f"Checkpoint: not resuming from {dirpath}: this fit continues the run "
                  f"restored from {source}.", flush=True)
            return None
    return files[-1] if files else None
