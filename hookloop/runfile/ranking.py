"""`TopK`: the k best scores of a run, best first. Pure: no files, no torch.

`Checkpoint(save_top_k=k)` asks it what a new validation does to the ranking (does it
enter, which entries drop out) and writes or deletes files from the answer. Keeping the
ranking apart from the files makes it testable with numbers worked out by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hookloop.errors import ConfigurationError
from hookloop.runfile.format import EPOCH, STEP, VALUE

__all__ = ["KEYS", "TopK", "check_ranking_options", "new_entry", "score"]

#: A ranking entry (`TopK`): the envelope's value, epoch and step, and the scored file.
FILE = "file"
KEYS = (FILE,)
SHARED_WORDS = frozenset(KEYS)

def new_entry(value: float, epoch: int, step: int, file: str | None) -> dict[str, Any]:
    """A ranking entry: ``file`` (a name, or None for ``best.pt``) scored ``value`` at ``epoch``
    and ``step``."""
    return {VALUE: float(value), EPOCH: int(epoch), STEP: int(step), FILE: file}


def score(ranked: Mapping[str, Any]) -> tuple[float, int]:
    """``(value, step)`` of a ranking entry: what names its file."""
    return ranked[VALUE], ranked[STEP]


#: ``better(value, other)``: True when ``value`` beats ``other`` (`hookloop.monitor.Monitor.better`).
Better = Callable[[float, float], bool]


def check_ranking_options(owner: str, monitor: str | None, save_top_k: int | None,
                          initial_value_threshold: float | None) -> None:
    """``save_top_k`` and ``initial_value_threshold`` rank files by a monitored metric: given
    without ``monitor``, they are refused, naming the option and the fix."""
    if monitor is None and (save_top_k != 1 or initial_value_threshold is not None):
        option = "save_top_k" if save_top_k != 1 else "initial_value_threshold"
        raise ConfigurationError(f"{owner} {option}= ranks files by a monitored metric, but "
                                 "monitor is None: pass monitor='val_loss' (or another).")


class TopK:
    """The ``k`` best scores seen, best first; what a new score does to them.

    An entry is a dict ``{"value", "epoch", "step", "file"}`` (``file``: the name of the
    file holding its weights, or None when the caller keeps no file per entry). A value
    enters when fewer than ``k`` are kept or when it beats the ``k``-th strictly, so of
    equal values the earlier stays ahead and a later tie never pushes it out.

    A score at a step the ranking holds already is the same weights validated again (a
    run resumed before that step replays its validation, or a step validation and the
    epoch's fall on one step): it replaces that entry when it beats it, and is not
    counted a second time otherwise.

    Args:
        better: ``better(value, other)``, True when ``value`` beats ``other``.
        k: How many entries to keep; None keeps every one.

    Example:
        >>> ranking = TopK(lambda value, other: value > other, k=2)
        >>> ranking.offer(0.5, epoch=0, step=10, file="a.pt"), ranking.offer(0.7, 1, 20, "b.pt")
        ([], [])
        >>> [entry["file"] for entry in ranking.offer(0.6, epoch=2, step=30, file="c.pt")]
        ['a.pt']
        >>> [(entry["value"], entry["step"]) for entry in ranking.entries]
        [(0.7, 20), (0.6, 30)]
        >>> ranking.admits(0.6, step=40)  # a tie with the 2nd best does not enter
        False
        >>> ranking.admits(0.6, step=30)  # step 30 again, no better: not counted twice
        False
    """

    def __init__(self, better: Better, k: int | None) -> None:
        self.better = better
        self.k = k
        #: The kept entries, best first.
        self.entries: list[dict[str, Any]] = []

    @property
    def best_value(self) -> float | None:
        """The best entry's value, or None while nothing is kept."""
        return self.entries[0][VALUE] if self.entries else None

    @property
    def best(self) -> dict[str, Any] | None:
        """The best entry, or None while nothing is kept."""
        return self.entries[0] if self.entries else None

    def files(self) -> set[str]:
        """The file names the kept entries hold (a file named here must not be deleted)."""
        return {entry[FILE] for entry in self.entries if entry[FILE] is not None}

    def at_step(self, step: int) -> dict[str, Any] | None:
        """The entry reached at optimizer ``step``, or None."""
        return next((entry for entry in self.entries if entry[STEP] == step), None)

    def admits(self, value: float, step: int) -> bool:
        """Whether `offer` would keep ``value`` (reached at ``step``) now."""
        same = self.at_step(step)
        if same is not None:
            return self.better(value, same[VALUE])
        if self.k is None or len(self.entries) < self.k:
            return True
        return self.better(value, self.entries[-1][VALUE])

    def offer(self, value: float, epoch: int, step: int, file: str | None) -> list[dict[str, Any]]:
        """Rank a new score; return the entries that drop out (it, when it does not enter).

        Args:
            value: The score.
            epoch: The epoch it was reached in (-1: not known, e.g. read from a file name).
            step: The optimizer step it was reached at.
            file: The name of the file holding its weights, or None.
        """
        entry = new_entry(value, epoch, step, file)
        replaced = []
        same = self.at_step(entry[STEP])
        if same is not None:
            if not self.better(entry[VALUE], same[VALUE]):
                return [entry]
            self.entries.remove(same)
            replaced.append(same)
        # After the equal-or-better entries: of equal scores the earlier stays ahead.
        place = next((index for index, other in enumerate(self.entries)
                      if self.better(entry[VALUE], other[VALUE])), len(self.entries))
        self.entries.insert(place, entry)
        if self.k is None or len(self.entries) <= self.k:
            return replaced
        dropped = self.entries[self.k:]
        del self.entries[self.k:]
        return replaced + dropped

    def merge(self, found: Iterable[Mapping[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
        """Rank entries found on disk that the saved state does not know.

        After a kill between a validation and the next checkpoint, the files of that
        validation exist but the state resumed from predates them. They are offered in step
        order, as the validations happened, so ties resolve as they did.

        Returns:
            Each entry that dropped out, with the step of the entry whose offer dropped it.
        """
        dropped: list[tuple[int, dict[str, Any]]] = []
        for entry in sorted(found, key=lambda item: item[STEP]):
            out = self.offer(entry[VALUE], entry[EPOCH], entry[STEP], entry[FILE])
            dropped += [(entry[STEP], item) for item in out]
        return dropped

    def state_dict(self) -> list[dict[str, Any]]:
        """The kept entries, best first, as plain dicts."""
        return [dict(entry) for entry in self.entries]

    def load_state_dict(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Restore `state_dict` (entries best first, as saved)."""
        self.entries = [{VALUE: float(entry[VALUE]), EPOCH: int(entry[EPOCH]),
                         STEP: int(entry[STEP]), FILE: entry[FILE]}
                        for entry in entries]
