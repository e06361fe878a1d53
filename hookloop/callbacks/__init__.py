"""The built-in callbacks. Stack them in a list, in the order they should run."""

from __future__ import annotations

__all__: list[str] = []
