"""Exact comparison of states for the callback test kit (`hookloop.testing`): where two
nested values (dicts, lists, tensors, numbers) differ, tensors compared with
``torch.equal`` (NaN equal to NaN), and a value with some mapping entries left out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["difference", "without"]


def difference(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors with torch.equal), or None.

    Example:
        >>> difference({"step": 3, "w": torch.ones(2)}, {"step": 3, "w": torch.zeros(2)})
        "['w']: values differ"
        >>> difference([1, float("nan")], [1, float("nan")]) is None
        True
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, where)
    if isinstance(a, dict) and isinstance(b, dict):
        return _mapping_difference(a, b, where)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return _sequence_difference(a, b, where)
    if a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        return None
    return f"{where or 'value'}: {a!r:.80} vs {b!r:.80}"


def _tensor_difference(a: Any, b: Any, where: str) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{where or 'value'}: {type(a).__name__} vs {type(b).__name__}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{where or 'tensor'}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    same = torch.equal(a.cpu(), b.cpu()) or (
        a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a[~a.isnan()].cpu(), b[~b.isnan()].cpu()))
    return None if same else f"{where or 'tensor'}: values differ"


def _mapping_difference(a: dict[Any, Any], b: dict[Any, Any], where: str) -> str | None:
    if a.keys() != b.keys():
        return (f"{where or 'state'}: keys {sorted(map(str, a.keys() - b.keys()))} only in "
                f"the first, {sorted(map(str, b.keys() - a.keys()))} only in the second")
    for key in a:
        found = difference(a[key], b[key], f"{where}[{key!r}]")
        if found:
            return found
    return None


def _sequence_difference(a: Sequence[Any], b: Sequence[Any], where: str) -> str | None:
    if len(a) != len(b):
        return f"{where or 'list'}: {len(a)} items vs {len(b)}"
    for index, (x, y) in enumerate(zip(a, b)):
        found = difference(x, y, f"{where}[{index}]")
        if found:
            return found
    return None


def without(value: Any, keys: Sequence[str]) -> Any:
    """``value`` with the mapping entries named ``keys`` left out, at any depth.

    Example:
        >>> without({"a": 1, "b": {"time": 2, "c": 3}}, ["time"])
        {'a': 1, 'b': {'c': 3}}
    """
    if not keys:
        return value
    if isinstance(value, dict):
        return {key: without(item, keys) for key, item in value.items() if key not in keys}
    if isinstance(value, (list, tuple)):
        return [without(item, keys) for item in value]
    return value
