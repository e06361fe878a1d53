"""Capture and restore every random number generator a training run draws from.

States are stored as tensors, ints and lists only, so a checkpoint holding them loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hookloop.errors import is_int

#: The keys of a generators' state (`capture_rng`): this module writes, checks and reads them.
RNG_TORCH, RNG_GENERATORS, RNG_CUDA = "torch", "generators", "cuda"
RNG_PYTHON, RNG_NUMPY = "python", "numpy"
KEYS = (RNG_TORCH, RNG_GENERATORS, RNG_CUDA, RNG_PYTHON, RNG_NUMPY)
#: Every one is also an ordinary word elsewhere (a device type, a library's name).
SHARED_WORDS = frozenset(KEYS)

__all__ = ["KEYS", "RNG_TORCH", "RNG_GENERATORS", "RNG_CUDA", "RNG_PYTHON", "RNG_NUMPY",
           "capture_rng", "cuda_rng", "host_rng", "restore_rng", "restore_host_rng",
           "restore_generators", "loader_generators", "rng_state_problem"]

try:  # numpy is optional
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy ships with most torch installs
    _numpy = None  # type: ignore[assignment]


def loader_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader (or its samplers) draws its order from."""
    found: list[torch.Generator] = []
    candidates = [
        getattr(data, "generator", None),
        getattr(getattr(data, "sampler", None), "generator", None),
        getattr(getattr(getattr(data, "batch_sampler", None), "sampler", None), "generator", None),
    ]
    for candidate in candidates:
        if isinstance(candidate, torch.Generator) and all(candidate is not g for g in found):
            found.append(candidate)
    return found


def capture_rng(generators: Iterable[torch.Generator] = (), *, full: bool = True) -> dict[str, Any]:
    """Snapshot the torch CPU and CUDA generators and ``generators`` (about 2 microseconds);
    with ``full``, also Python's and NumPy's global generators (`host_rng`)."""
    state: dict[str, Any] = {
        RNG_TORCH: torch.default_generator.get_state(),  # torch.get_rng_state(), one call less
        RNG_GENERATORS: [generator.get_state() for generator in generators] if generators else [],
    }
    # is_initialized first: it is a flag, is_available asks the driver (microseconds).
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        state.update(cuda_rng())
    if full:
        state.update(host_rng())
    return state


def cuda_rng() -> dict[str, Any]:
    """Every CUDA device's generator, under its key of a `capture_rng` state."""
    return {RNG_CUDA: torch.cuda.get_rng_state_all()}


def host_rng() -> dict[str, Any]:
    """Python's and NumPy's global generators: about 70 microseconds (NumPy's copy of its
    624 words is most of it), so they are captured when a state is read, not at every step."""
    python_version, python_state, python_gauss = random.getstate()
    state: dict[str, Any] = {RNG_PYTHON: [python_version, list(python_state), python_gauss]}
    if _numpy is not None:
        numpy_state: Any = _numpy.random.get_state()  # the legacy tuple
        kind, keys, position, has_gauss, cached = numpy_state
        state[RNG_NUMPY] = [kind, torch.from_numpy(keys.astype("int64")), int(position),
                          int(has_gauss), float(cached)]
    return state


def restore_rng(state: dict[str, Any], generators: Iterable[torch.Generator] = ()) -> None:
    """Put back what `capture_rng` returned (generators in the same order)."""
    restore_host_rng(state)
    torch.set_rng_state(state[RNG_TORCH].cpu())
    restore_generators(state, generators)
    if RNG_CUDA in state and torch.cuda.is_available():
        cuda_states = [s.cpu() for s in state[RNG_CUDA]][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda_states)


def restore_generators(state: Mapping[str, Any], generators: Iterable[torch.Generator]) -> None:
    """Put back only ``generators`` (a DataLoader's) of a `capture_rng` state, in order."""
    for generator, saved in zip(generators, state.get(RNG_GENERATORS, ())):
        generator.set_state(saved.cpu())


def restore_host_rng(state: Mapping[str, Any]) -> None:
    """Put back Python's and NumPy's generators of a state, where it holds them."""
    if RNG_PYTHON in state:
        version, python_state, gauss = state[RNG_PYTHON]
        random.setstate((version, tuple(python_state), gauss))
    if RNG_NUMPY in state and _numpy is not None:
        kind, keys, position, has_gauss, cached = state[RNG_NUMPY]
        _numpy.random.set_state((kind, keys.numpy().astype("uint32"), position, has_gauss, cached))


def _is_byte_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


def _host_rng_problem(state: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    for field, size in ((RNG_PYTHON, 3), (RNG_NUMPY, 5)):
        if field in state and (not isinstance(state[field], list) or len(state[field]) != size):
            return field, state[field], f"a list of {size} items"
    if RNG_PYTHON in state:
        version, words, gauss = state[RNG_PYTHON]
        for index, value, ok, expected in (
                (0, version, is_int(version), "an int (the generator's version)"),
                (1, words, isinstance(words, list) and all(is_int(word) for word in words),
                 "a list of ints"),
                (2, gauss, gauss is None or isinstance(gauss, float), "a float or None")):
            if not ok:
                return f"{RNG_PYTHON}[{index}]", value, expected
    if RNG_NUMPY in state:
        kind, keys, position, has_gauss, cached = state[RNG_NUMPY]
        for index, value, ok, expected in (
                (0, kind, isinstance(kind, str), "a str"),
                (1, keys, isinstance(keys, torch.Tensor) and keys.dtype == torch.int64,
                 "an int64 tensor"),
                (2, position, is_int(position), "an int"),
                (3, has_gauss, is_int(has_gauss), "an int"),
                (4, cached, isinstance(cached, float), "a float")):
            if not ok:
                return f"{RNG_NUMPY}[{index}]", value, expected
    return None


def rng_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """The first field of a saved `hookloop.engine.rng.capture_rng` state with the wrong type, or
    None.

    A checkpoint file read back may have been edited or written by another program;
    restoring a wrong state fails deep inside torch or NumPy without naming the field.

    Returns:
        ``(field, value, expected)``: the field's name inside the state (``""`` for the
        state itself), its value, and what it should be.

    Example:
        >>> from hookloop.engine.rng import capture_rng
        >>> rng_state_problem(capture_rng()) is None
        True
        >>> rng_state_problem({"torch": "abc"})
        ('torch', 'abc', 'a uint8 tensor')
    """
    if not isinstance(state, Mapping):
        return "", state, "a dict"
    if not _is_byte_tensor(state.get(RNG_TORCH)):
        return RNG_TORCH, state.get(RNG_TORCH), "a uint8 tensor"
    for field in (RNG_GENERATORS, RNG_CUDA):
        states = state.get(field, [])
        if not isinstance(states, list):
            return field, states, "a list of uint8 tensors"
        for index, item in enumerate(states):
            if not _is_byte_tensor(item):
                return f"{field}[{index}]", item, "a uint8 tensor"
    return _host_rng_problem(state)
