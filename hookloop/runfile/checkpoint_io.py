"""What the `hookloop.callbacks.Checkpoint` callback builds on, in one place: the files of
its directory (`hookloop.runfile.checkpoint_files`: names, atomic writes, integrity, retirement),
the background writes (`hookloop.runfile.background_save`), the clock of timed saves
(`hookloop.parallel.suspension`), the ranking of the best validations (`hookloop.runfile.ranking`), the
model's state as saved (`hookloop.runfile.sharded`), the finiteness check (`hookloop.runfile.weights`),
`load_checkpoint` (`hookloop.runfile.loading`) and the keys of the file it reads (`hookloop.runfile.format`).

The callback keeps the policy (when to save, which files to keep, which to resume); the IO
and the integrity live below it, reached through this module only.
"""

from __future__ import annotations

from hookloop.parallel.suspension import TimedSaves
from hookloop.runfile.background_save import RotatingWrites
from hookloop.runfile.checkpoint_files import CheckpointFiles
from hookloop.runfile.format import MODEL, VALUE
from hookloop.runfile.loading import load_checkpoint
from hookloop.runfile.ranking import TopK
from hookloop.runfile.sharded import model_state
from hookloop.runfile.weights import all_finite

__all__ = ["CheckpointFiles", "MODEL", "RotatingWrites", "TimedSaves", "TopK", "VALUE",
           "all_finite", "load_checkpoint", "model_state"]
