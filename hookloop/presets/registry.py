"""Finding presets by name: the built-in ones, and those other packages publish.

A package publishes a preset through the entry-point group ``hookloop.presets``. Reading
that group costs no import: the names come from the installed packages' metadata. A
package's module is imported only when one of its presets is asked for by name (`get`) or
when every preset is listed (`available`, ``hookloop presets``, the error for a name no
package publishes), so a built-in name never runs another package's code, and a slow or
broken package slows or breaks only the calls that need it.

Whatever a package's module raises while it is imported (``SystemExit`` included; only
``KeyboardInterrupt`` goes through) is reported with the package's name: as a warning when
listing, and as a `ConfigurationError` when that preset is asked for. Two packages
publishing one name, or a package publishing a built-in name, are found from the metadata
alone and reported the same way.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hookloop.callback import Callback
from hookloop.errors import ConfigurationError, with_article

__all__ = ["ENTRY_POINT_GROUP", "Entry", "available", "entries", "get", "requires"]

#: The entry-point group other packages publish their presets in.
ENTRY_POINT_GROUP = "hookloop.presets"

# The presets hookloop itself defines (hookloop.presets.builtin, shown as hookloop.presets);
# a package cannot take these names. That module is imported at call time: importing the
# registry imports no callback.
_BUILT_IN_NAMES = ("standard", "finetune", "debug")

PresetFunction = Callable[..., list[Callback]]


@dataclass(frozen=True)
class Entry:
    """One preset: built in, or published by a package, and usable or not (with why).

    Attributes:
        name: The name `get` knows it by.
        package: ``"hookloop"`` for a built-in, else ``"<distribution> <version>"`` (several,
            comma-separated, when packages clash over the name).
        function: The preset function; None when the preset cannot be used.
        problem: Why it cannot be used; None when it can.
        requires: The hookloop versions the preset declares it supports (its function's
            ``requires`` attribute, e.g. ``">=0.1,<0.3"``; see `requires`), or None.

    Example:
        >>> from hookloop.presets.registry import entries
        >>> usable, problems = entries()
        >>> usable["standard"].package
        'hookloop'
    """

    name: str
    package: str
    function: PresetFunction | None = None
    problem: str | None = None
    requires: str | None = None

    @property
    def description(self) -> str:
        """The first line of the preset's docstring, or why it cannot be used."""
        if self.function is None:
            return f"not usable: {self.problem}"
        doc = inspect.getdoc(self.function) or ""
        return doc.strip().splitlines()[0] if doc.strip() else "(no description)"


def _built_ins() -> dict[str, PresetFunction]:
    from hookloop.presets import builtin as builtin_presets

    return {name: getattr(builtin_presets, name) for name in _BUILT_IN_NAMES}


def _package_of(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return f"unknown package ({entry_point.value})"
    return f"{dist.name} {dist.version}"


def _published() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """The installed packages' preset names and their entry points, read from metadata only."""
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(entry_point.name, []).append(entry_point)
    return by_name


def _refusal(name: str, entry_points: list[importlib.metadata.EntryPoint]) -> Entry | None:
    """The entry for a published name that metadata alone shows cannot be used, else None."""
    packages = ", ".join(_package_of(entry_point) for entry_point in entry_points)
    if name in _BUILT_IN_NAMES:
        return Entry(name, packages, problem=(
            f"{name!r} is the name of a built-in preset, which keeps it; the package must "
            "publish its preset under another name"))
    if len(entry_points) > 1:
        return Entry(name, packages, problem=(
            f"{len(entry_points)} installed packages publish a preset named {name!r}, so none "
            "of them is used; uninstall all but one"))
    return None


def _load(name: str, entry_point: importlib.metadata.EntryPoint
          ) -> tuple[Entry, BaseException | None]:
    """Import one published preset; whatever its import raises becomes the entry's problem.

    Returns:
        The entry, and the exception its import raised (None when it imported).
    """
    package = _package_of(entry_point)
    try:
        function = entry_point.load()
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # SystemExit too: a package's import must not end the caller
        detail = f": {error}" if str(error) else ""
        return Entry(name, package, problem=(
            f"importing {entry_point.value} failed with {type(error).__name__}{detail}")), error
    if not callable(function):
        return Entry(name, package, problem=(
            f"{entry_point.value} is {with_article(type(function).__name__)}, not a function "
            "returning a list of callbacks")), None
    spec = getattr(function, "requires", None)
    if spec is None:
        return Entry(name, package, function), None
    return Entry(name, package, function if _supported(spec) is None else None,
                 _supported(spec), str(spec)), None


def _supported(spec: Any) -> str | None:
    """Why this hookloop is outside the range ``spec``, or None when it is inside."""
    from hookloop import __version__
    from hookloop.base.versions import satisfies

    try:
        if satisfies(__version__, spec):
            return None
    except ConfigurationError as error:
        return f"its hookloop version range cannot be read ({error})"
    return (f"it supports hookloop {spec} and this is hookloop {__version__}; install a "
            f"release of the package made for hookloop {__version__}, or a hookloop in {spec}")


def requires(spec: str) -> Callable[[PresetFunction], PresetFunction]:
    """Declare the hookloop versions a preset supports: ``@requires(">=0.1,<0.3")``.

    It sets the function's ``requires`` attribute (which may also be set by hand). A preset
    whose range does not hold this hookloop is refused when used (`get` raises a
    `ConfigurationError` naming both versions) and left out of `available` with a warning;
    ``hookloop presets`` shows every preset's range. The range is a comma-separated list
    of clauses, read by `hookloop.base.versions` (no dependency on ``packaging``).

    Raises:
        ConfigurationError: a range that cannot be read (said when the preset is defined).

    Example:
        >>> from hookloop.callbacks import GradClip
        >>> @requires(">=0.1,<1")
        ... def tight(max_norm=0.1):
        ...     "Clip hard."
        ...     return [GradClip(max_norm)]
        >>> tight.requires
        '>=0.1,<1'
    """
    from hookloop.base.versions import check_range

    check_range(spec, owner="requires")

    def mark(function: PresetFunction) -> PresetFunction:
        function.requires = spec  # type: ignore[attr-defined]
        return function

    return mark


def _resolve(name: str, entry_points: list[importlib.metadata.EntryPoint]
             ) -> tuple[Entry, BaseException | None]:
    """The entry of one published name: refused from metadata, or imported."""
    refused = _refusal(name, entry_points)
    return (refused, None) if refused is not None else _load(name, entry_points[0])


def entries() -> tuple[dict[str, Entry], list[Entry]]:
    """Every preset, importing each published one: the usable ones by name, and the others.

    Returns:
        ``(usable, problems)``: the usable presets by name (built-ins first), and the
        published presets that cannot be used, each with its package and the reason.

    Example:
        >>> from hookloop.presets.registry import entries
        >>> usable, problems = entries()
        >>> sorted(set(usable) & {"standard", "finetune", "debug"})
        ['debug', 'finetune', 'standard']
    """
    usable = {name: Entry(name, "hookloop", function) for name, function in _built_ins().items()}
    problems: list[Entry] = []
    published = _published()
    for name in sorted(published):
        entry, _ = _resolve(name, published[name])
        if entry.function is None:
            problems.append(entry)
        else:
            usable[name] = entry
    return usable, problems


def _warn(problems: list[Entry]) -> None:
    for entry in problems:
        warnings.warn(f"hookloop preset {entry.name!r} from {entry.package} is not available: "
                      f"{entry.problem}.", RuntimeWarning, stacklevel=3)


def available() -> dict[str, str]:
    """Every preset that `get` can build: ``{name: one-line description}``, sorted by name.

    Listing imports every package that publishes a preset, to read its description. An
    installed preset that cannot be used (its package fails to import, it takes a
    built-in name, two packages publish the same name) is left out with a warning naming
    it and its package; the others are listed. ``hookloop presets`` prints the same list
    with the package each preset comes from.

    Returns:
        Preset names mapped to the first line of their docstring.

    Example:
        >>> from hookloop import presets
        >>> sorted(set(presets.available()) & {"standard", "finetune", "debug"})
        ['debug', 'finetune', 'standard']
    """
    usable, problems = entries()
    _warn(problems)
    return {name: usable[name].description for name in sorted(usable)}


def _find(name: str) -> Entry:
    """The usable preset called ``name``, importing at most the one package publishing it."""
    built_in = _built_ins()
    if name in built_in:  # no metadata read, no other package imported
        return Entry(name, "hookloop", built_in[name])
    published = _published()
    if name in published:
        entry, error = _resolve(name, published[name])
        if entry.function is None:
            # Chained, so the package's own traceback shows where its import failed.
            raise ConfigurationError(
                f"The preset {name!r} from {entry.package} cannot be used: {entry.problem}."
            ) from error
        return entry
    # The message lists what can be built instead, which needs every package imported (the
    # error path only): a name shown as available must be one `get` can build.
    usable, problems = entries()
    _warn(problems)
    names = sorted(usable)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigurationError(
        f"No preset named {name!r}.{hint} Available: {', '.join(names)}. Presets of other "
        f"packages appear here once installed (entry-point group {ENTRY_POINT_GROUP!r}); "
        "`hookloop presets` lists them.")


def get(name: str, **kwargs: Any) -> list[Callback]:
    """Build the preset called ``name`` with ``kwargs``: ``get("standard", ema=None)``.

    A built-in name imports no other package. Another name imports only the package that
    publishes it; a name nobody publishes imports them all, to list the presets there are.

    Args:
        name: A built-in preset (``"standard"``, ``"finetune"``, ``"debug"``) or one an
            installed package publishes (see `available`).
        **kwargs: The preset's arguments.

    Returns:
        A new list of callbacks.

    Raises:
        ConfigurationError: an unknown name (the message lists the available ones), a
            preset whose package cannot be imported or clashes with another (naming the
            package and the reason), an argument the preset does not take (with the ones it
            does), or a preset that does not return a list of callbacks.

    Example:
        >>> from hookloop import presets
        >>> callbacks = presets.get("finetune", tensorboard=None, progress=False)
        >>> type(callbacks[0]).__name__
        'AMP'
    """
    if not isinstance(name, str):
        raise ConfigurationError(f"A preset name is a string such as 'standard', got {name!r}.")
    entry = _find(name)
    function = entry.function
    assert function is not None
    try:
        inspect.signature(function).bind(**kwargs)
    except TypeError as error:
        raise ConfigurationError(
            f"Preset {name!r} ({entry.package}): {error}. Its parameters: "
            f"{_parameters(function)}.") from None
    except ValueError:  # no signature to check (a builtin or C function): just call it
        pass
    callbacks = function(**kwargs)
    if isinstance(callbacks, tuple):
        callbacks = list(callbacks)
    if not isinstance(callbacks, list) or not all(isinstance(c, Callback) for c in callbacks):
        raise ConfigurationError(
            f"Preset {name!r} ({entry.package}) returned {type(callbacks).__name__} "
            f"{callbacks!r:.200}, not a list of hookloop.Callback instances; that is a bug in "
            "the preset's package.")
    return callbacks


def _parameters(function: Callable[..., Any]) -> str:
    try:
        parameters = inspect.signature(function).parameters.values()
    except ValueError:
        return "unknown"
    return ", ".join(
        parameter.name if parameter.default is inspect.Parameter.empty
        else f"{parameter.name}={parameter.default!r}" for parameter in parameters) or "none"
