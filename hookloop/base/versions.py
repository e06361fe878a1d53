"""Version ranges, as a preset declares the hookloop versions it supports.

A small, dependency-free reading of PEP 440 specifiers (``packaging`` is not a runtime
dependency of hookloop): comma-separated clauses, each an operator among ``>=``, ``<=``,
``>``, ``<``, ``==``, ``!=``, ``~=`` and a version of dot-separated numbers; ``==1.2.*`` and
``!=1.2.*`` match a prefix. A suffix after the numbers (``rc1``, ``.dev0``, ``+local``) is
ignored: ``1.0rc1`` compares as ``1.0``.
"""

from __future__ import annotations

import re

from hookloop.errors import ConfigurationError

__all__ = ["check_range", "parse_version", "satisfies"]

_CLAUSE = re.compile(r"^\s*(~=|==|!=|<=|>=|<|>)\s*([0-9][0-9.]*?)(\.\*)?\s*$")
_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def parse_version(version: str) -> tuple[int, ...]:
    """The release numbers of ``version``: ``"0.1.0"`` gives ``(0, 1, 0)``.

    Example:
        >>> parse_version("2.13.0+cpu"), parse_version("1.0rc1")
        ((2, 13, 0), (1, 0))
    """
    found = _RELEASE.match(version)
    if found is None:
        raise ConfigurationError(f"{version!r} is not a version such as 0.1.0.")
    return tuple(int(part) for part in found.group(1).split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def check_range(spec: str, *, owner: str = "requires") -> list[tuple[str, tuple[int, ...], bool]]:
    """The clauses of ``spec`` as ``(operator, version, wildcard)``; a `ConfigurationError`
    naming ``owner`` when it cannot be read."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError(f"{owner}: a version range is a string such as '>=0.1,<0.3', "
                                 f"got {spec!r}.")
    clauses = []
    for text in spec.split(","):
        found = _CLAUSE.match(text)
        if found is None or found.group(2).endswith("."):
            raise ConfigurationError(
                f"{owner}: {text.strip()!r} in {spec!r} is not a clause hookloop reads: use "
                "an operator (>=, <=, >, <, ==, !=, ~=) and a version of numbers, such as "
                "'>=0.1,<0.3' or '==0.1.*'.")
        operator, version, wildcard = found.group(1), found.group(2), bool(found.group(3))
        if wildcard and operator not in ("==", "!="):
            raise ConfigurationError(f"{owner}: {text.strip()!r}: only == and != take '.*'.")
        clauses.append((operator, parse_version(version), wildcard))
    _check_not_empty(spec, owner, clauses)
    return clauses


Bound = tuple[tuple[int, ...], bool]  # a version, and whether it is itself in the range


def _check_not_empty(spec: str, owner: str,
                     clauses: list[tuple[str, tuple[int, ...], bool]]) -> None:
    """Refuse a range no version can satisfy (``'>=0.1,<0.0'``): the preset could never be
    used, and it would only say so on the machine that tries."""
    lows, highs, excluded = _bounds(clauses)
    if not lows or not highs:
        return
    width = max(len(version) for version, _ in (*lows, *highs))

    def padded(version: tuple[int, ...]) -> tuple[int, ...]:
        return version + (0,) * (width - len(version))

    low = max(lows, key=lambda bound: (padded(bound[0]), not bound[1]))  # the tightest
    high = min(highs, key=lambda bound: (padded(bound[0]), bound[1]))
    single = padded(low[0]) == padded(high[0]) and low[1] and high[1]  # one version left
    if padded(low[0]) > padded(high[0]) or (padded(low[0]) == padded(high[0]) and not single) \
            or (single and any(len(set(_padded(version, low[0]))) == 1  # != that one
                               for version in excluded)):
        raise ConfigurationError(
            f"{owner}: {spec!r} is an empty range: no version satisfies all its clauses, so "
            "the preset could never be used. Check the bounds: the lower one first and "
            "below the upper one, e.g. '>=0.1,<0.3'.")


def _bounds(clauses: list[tuple[str, tuple[int, ...], bool]]
            ) -> tuple[list[Bound], list[Bound], list[tuple[int, ...]]]:
    """The lower and upper bounds the clauses set, and the versions ``!=`` leaves out."""
    lows: list[Bound] = []
    highs: list[Bound] = []
    excluded: list[tuple[int, ...]] = []
    for operator, version, wildcard in clauses:
        if operator == "==" and wildcard:  # ==1.2.*: from 1.2 up to, not including, 1.3
            lows.append((version, True))
            highs.append((version[:-1] + (version[-1] + 1,), False))
        elif operator == "~=" and len(version) >= 2:  # ~=1.2.3: >=1.2.3, ==1.2.*
            lows.append((version, True))
            highs.append((version[:-2] + (version[-2] + 1,), False))
        elif operator in ("==", ">=", ">"):
            lows.append((version, operator != ">"))
        if operator in ("==", "<=", "<") and not wildcard:
            highs.append((version, operator != "<"))
        if operator == "!=" and not wildcard:
            excluded.append(version)
    return lows, highs, excluded


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` is in the range ``spec``.

    Example:
        >>> satisfies("0.1.0", ">=0.1,<0.3"), satisfies("0.3.1", ">=0.1,<0.3")
        (True, False)
        >>> satisfies("0.2.5", "~=0.2.1"), satisfies("0.2.5", "==0.2.*"), satisfies("1.0", "!=1.*")
        (True, True, False)
    """
    have = parse_version(version)
    for operator, wanted, wildcard in check_range(spec):
        if wildcard:
            inside = have[:len(wanted)] == wanted
            if inside != (operator == "=="):
                return False
            continue
        a, b = _padded(have, wanted)
        if operator == "~=":
            if len(wanted) < 2:
                raise ConfigurationError(f"{spec!r}: ~= needs at least two numbers (~=0.1).")
            if not (a >= b and have[:len(wanted) - 1] == wanted[:-1]):
                return False
            continue
        ok = {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b,
              "<": a < b}[operator]
        if not ok:
            return False
    return True
