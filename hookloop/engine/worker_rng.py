"""A DataLoader worker's generator states after each batch, read at a fraction of the cost
of a batch: Python's and NumPy's states are taken in full only when they changed.

`hookloop.engine.resumable.WorkerStamp` stamps every batch a worker makes with the
worker's states, so that a resume inside an epoch restarts each worker from them. Taking
them in full every time (``random.getstate()`` builds 625 Python ints, NumPy's legacy
``get_state()`` copies its 624 words one by one) cost as much as making a cheap batch.
Most datasets never draw from Python's or NumPy's global generators, so `StateReads`
compares their raw words with those of the worker's previous batch instead (one memory
copy each) and sends `SAME` when nothing moved; the main process puts the previous
batch's state of the same worker in its place (`resolved`). torch's generator is read at
every batch (a single copy of its state).

The raw words are read where the generators keep them: NumPy's through its documented
``bit_generator.ctypes.state_address`` (``mt19937_state``: 624 words, then the position),
Python's at the start of the ``_random.Random`` object (its index, then 624 words), each
checked once per process against the full state read (and not used when they differ, or
outside CPython). Exactness: a generator whose words and position did not move drew
nothing, with one exception that is kept exact: NumPy's legacy normal draws keep a cached
value (``has_gauss``) that is used up without moving the words, so while a cached value
exists the full state is read at every batch; Python's cached ``gauss_next`` is compared
as it is. Not seen: a dataset that calls ``numpy.random.set_state`` with the same words
and position but a cached value that was not there (only ``set_state`` can add one without
a draw); such a dataset keeps exact stamps by drawing once after it, or by its own state.
"""

from __future__ import annotations

import ctypes
import random
import sys
from typing import Any

import torch

try:  # numpy is optional
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    _numpy = None  # type: ignore[assignment]

__all__ = ["SAME", "StateReads", "resolved"]

#: In a stamp: this generator's state is the one of the worker's previous batch.
SAME = "same-as-previous"

_WORDS = 624  # both generators are a Mersenne Twister of 624 32-bit words
_PYTHON_OFFSET = object.__basicsize__  # the index and the words follow the object's head
_RAW_BYTES = 4 * _WORDS + 4


def _words(address: int) -> Any:
    """The raw words at ``address`` as a ctypes array: ``.raw`` copies them into bytes (one
    memory copy, no foreign call)."""
    return (ctypes.c_char * _RAW_BYTES).from_address(address)


def _c_random(owner: Any) -> bool:
    """Whether ``owner`` is CPython's C generator (or a subclass): its words are where
    `_python_raw` reads them, inside the object."""
    import _random

    return isinstance(owner, _random.Random) and \
        type(owner).__basicsize__ >= _PYTHON_OFFSET + _RAW_BYTES


def _python_generator() -> Any:
    """The generator the ``random`` module's functions draw from."""
    return getattr(random.getstate, "__self__", None)


def _python_raw() -> bytes:
    return _words(id(_python_generator()) + _PYTHON_OFFSET).raw


def _python_raw_readable() -> bool:
    """Whether Python's generator keeps its index and words where `_python_raw` reads them:
    checked against ``random.getstate()`` (CPython only, the object at least that big)."""
    if sys.implementation.name != "cpython" or not _c_random(_python_generator()):
        return False
    raw = _python_raw()
    words = list(memoryview(raw[4:]).cast("I"))
    index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
    return random.getstate()[1] == tuple(words) + (index,)


def _numpy_address() -> int | None:
    """Where NumPy's global MT19937 keeps its words and position, checked once against its
    ``state``; None when it is another generator or the layout differs."""
    generator = _numpy.random.mtrand._rand._bit_generator  # type: ignore[union-attr]
    if type(generator).__name__ != "MT19937":
        return None
    address = generator.ctypes.state_address
    raw = _words(address).raw
    state = generator.state["state"]
    same = bytes(memoryview(raw[:-4])) == state["key"].astype("uint32").tobytes() and \
        int.from_bytes(raw[-4:], sys.byteorder, signed=True) == int(state["pos"])
    return address if same else None


class StateReads:
    """The states of one worker process's generators at its previous stamp (`stamp`).

    Held by the `WorkerStamp` object, which every worker process gets its own copy of
    (forked, or unpickled without this state: `__getstate__`), so each worker's first
    stamp is whole."""

    __slots__ = ("_python_ok", "_python_owner", "_python_words", "_python_raw", "_python",
                 "_numpy_generator", "_numpy_words", "_numpy_raw", "_numpy")

    def __init__(self) -> None:
        self._python_ok: bool | None = None  # unknown until the first stamp
        self._python_owner: Any = None  # the generator `_python_words` reads (kept alive)
        self._python_words: Any = None
        self._python_raw: tuple[bytes, Any] | None = None
        self._python: Any = None
        self._numpy_generator: Any = None  # the generator `_numpy_words` reads (kept alive)
        self._numpy_words: Any = None
        self._numpy_raw: bytes | None = None
        self._numpy: Any = None

    def stamp(self) -> tuple[bytes, Any, Any]:
        """``(torch's state as bytes, Python's state or SAME, NumPy's state, None or SAME)``
        after the batch this worker just made."""
        torch_bytes = torch.default_generator.get_state().numpy().tobytes()
        return torch_bytes, self._python_state(), self._numpy_state()

    def _python_state(self) -> Any:
        if self._python_ok is None:
            self._python_ok = _python_raw_readable()
        if not self._python_ok:
            return random.getstate()
        # The generator the module's functions draw from (random._inst may be rebound
        # without them); its words are read only where it is the C generator's layout.
        owner: Any = _python_generator()
        if owner is not self._python_owner:
            if not _c_random(owner):
                return random.getstate()
            self._python_owner, self._python_words = owner, _words(id(owner) + _PYTHON_OFFSET)
        raw = (self._python_words.raw, owner.gauss_next)
        if raw == self._python_raw:
            return SAME
        self._python_raw, self._python = raw, random.getstate()
        return self._python

    def _numpy_state(self) -> Any:
        if _numpy is None:
            return None
        generator = _numpy.random.mtrand._rand._bit_generator
        if generator is not self._numpy_generator:  # the first stamp, or another generator
            self._numpy_generator, self._numpy_raw = generator, None
            address = _numpy_address()
            self._numpy_words = None if address is None else _words(address)
        if self._numpy_words is None:
            return _numpy.random.get_state()
        raw = self._numpy_words.raw
        # A cached normal value (has_gauss) can be used up without moving the words.
        if raw == self._numpy_raw and not self._numpy[3]:
            return SAME
        self._numpy_raw, self._numpy = raw, _numpy.random.get_state()
        return self._numpy


def resolved(stamp: tuple[Any, ...], previous: Any) -> tuple[Any, ...]:
    """``stamp`` with every `SAME` replaced by that generator's state in ``previous``, the
    stamp of the same worker's previous batch (already resolved)."""
    if not isinstance(previous, tuple):
        raise RuntimeError(
            "hookloop: a DataLoader worker stamped a batch with the generator states of its "
            "previous batch, which the main process does not hold: the loader did not give "
            "its batches to the workers in turn (in_order=True).")
    return tuple(prior if state == SAME else state for state, prior in zip(stamp, previous))
