"""A worker's stamps, with `SAME` for what did not move, resolve to exactly the full states
a worker would have read after each batch (the oracle: ``torch.get_rng_state()``,
``random.getstate()``, ``numpy.random.get_state()`` read in full), whatever the batch drew:
nothing, Python's generator, NumPy's uniform draws, and an odd number of NumPy's normal
draws, whose cached value is used up at the next one without moving NumPy's words."""

from __future__ import annotations

import pickle
import random

import numpy
import pytest
import torch

from hookloop.engine.worker_rng import SAME, StateReads, resolved

DRAWS = {
    "nothing": lambda: None,
    "python": lambda: random.random(),
    "python gauss": lambda: random.gauss(0.0, 1.0),
    "numpy uniform": lambda: numpy.random.random(),
    "numpy one normal": lambda: numpy.random.standard_normal(),
    "torch": lambda: torch.rand(2),
}
PATTERN = ["nothing", "nothing", "python", "nothing", "numpy one normal", "nothing",
           "numpy one normal", "nothing", "numpy one normal", "numpy one normal", "python gauss",
           "nothing", "python gauss", "torch", "numpy uniform", "nothing", "nothing"]


def _full() -> tuple:
    return (torch.default_generator.get_state().numpy().tobytes(), random.getstate(),
            numpy.random.get_state())


def _same(a: tuple, b: tuple) -> bool:
    (torch_a, python_a, numpy_a), (torch_b, python_b, numpy_b) = a, b
    return torch_a == torch_b and python_a == python_b and numpy_a[0] == numpy_b[0] and \
        numpy.array_equal(numpy_a[1], numpy_b[1]) and tuple(numpy_a[2:]) == tuple(numpy_b[2:])


def test_resolved_stamps_are_the_full_states_after_every_batch() -> None:
    random.seed(3)
    numpy.random.seed(3)
    reads, previous, skipped = StateReads(), None, 0
    for name in PATTERN:
        DRAWS[name]()
        stamp = pickle.loads(pickle.dumps(reads.stamp()))  # through a worker's queue
        skipped += SAME in stamp
        state = resolved(stamp, previous) if SAME in stamp else stamp
        assert _same(state, _full()), name
        previous = state
    assert skipped >= 8  # the batches that drew nothing from Python or NumPy sent neither


def test_a_worker_s_first_stamp_is_whole_and_a_lost_previous_one_is_named() -> None:
    stamp = StateReads().stamp()
    assert SAME not in stamp and _same(stamp, _full())
    with pytest.raises(RuntimeError, match="in_order=True"):
        resolved((b"", SAME, SAME), None)


def test_the_words_read_are_those_of_the_generator_the_module_draws_from(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the words were read at ``random._inst``, which a program may rebind
    (to any object: the read would then run past it) while ``random.random`` still draws
    from the original generator. They are read from the module functions' own generator,
    and only where it has the C generator's layout."""
    reads = StateReads()
    previous = reads.stamp()  # a first stamp is whole
    monkeypatch.setattr(random, "_inst", object())  # not a generator at all
    random.random()  # draws from the module's generator: its state moved
    stamp = reads.stamp()
    assert stamp[1] is not SAME
    assert resolved(stamp, previous)[1] == random.getstate()
    assert reads.stamp()[1] is SAME  # nothing drew since
