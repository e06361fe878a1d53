"""Exceptions hookloop raises. Each one is a class users can catch."""

from __future__ import annotations

__all__ = ["HookloopError", "CallbackOrderError", "CheckpointError", "ConfigurationError"]


class HookloopError(Exception):
    """Base class of every error hookloop raises on purpose."""


class ConfigurationError(HookloopError, ValueError):
    """The loop or a callback was given input it cannot use (detected before training)."""


class CallbackOrderError(ConfigurationError):
    """The callback stack breaks a constraint: wrong order, a missing metric, a clash.

    Raised at fit start, before the first batch. The message names the callbacks involved
    and says how to fix the stack.
    """


class CheckpointError(HookloopError):
    """A checkpoint file cannot be read or does not fit the model being trained."""
