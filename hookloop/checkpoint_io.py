"""What the `hookloop.callbacks.Checkpoint` callback builds on, in one place: the files of
its directory (`hookloop.checkpoint_files`: names, atomic writes, integrity, retirement),
the background writes (`hookloop.background_save`), the clock of timed saves
(`hookloop.suspension`), the ranking of the best validations (`hookloop.ranking`), the
model's state as saved (`hookloop.sharded`), the finiteness check (`hookloop.weights`),
`load_checkpoint` (`hookloop.loading`) and the keys of the file it reads (`hookloop.run_file`).

The callback keeps the policy (when to save, which files to keep, which to resume); the IO
and the integrity live below it, reached through this module only.
"""

from __future__ import annotations

from hookloop.background_save import RotatingWrites
from hookloop.checkpoint_files import CheckpointFiles
from hookloop.loading import load_checkpoint
from hookloop.ranking import TopK
from hookloop.run_file import MODEL, VALUE
from hookloop.sharded import model_state
from hookloop.suspension import TimedSaves
from hookloop.weights import all_finite

__all__ = ["CheckpointFiles", "MODEL", "RotatingWrites", "TimedSaves", "TopK", "VALUE",
           "all_finite", "load_checkpoint", "model_state"]
