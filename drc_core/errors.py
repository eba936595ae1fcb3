"""One exception type for problems a user can fix, and the CLI convention for reporting them."""

from __future__ import annotations

import sys
from collections.abc import Callable


class DrcError(ValueError):
    """A user-fixable problem. The message is one line: what is wrong, then how to fix it."""


def need_int(name: str, value: object, minimum: int, owner: str = "") -> int:
    """``value`` as an int, or a one-line :class:`DrcError` unless it is an integer (not a bool) >= ``minimum``;
    ``owner`` (e.g. a rule's name) prefixes the message."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        prefix = f"{owner}: " if owner else ""
        raise DrcError(f"{prefix}{name}={value!r} is invalid; it must be an integer >= {minimum}")
    return int(value)


def need_eps(eps: object) -> float:
    """A convergence threshold as a float, or a one-line :class:`DrcError` unless it is a finite number > 0."""
    import numbers

    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < float(eps) < float("inf"):
        raise DrcError(f"eps={eps!r} is invalid; it must be a finite number > 0")
    return float(eps)


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a CLI entry point; a :class:`DrcError` becomes one ``error:`` line and exit status 2."""
    try:
        return int(main(argv) or 0)
    except DrcError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
