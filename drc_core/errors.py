"""One exception type for problems a user can fix, and the CLI convention for reporting them."""

from __future__ import annotations

import sys
from collections.abc import Callable


class DrcError(ValueError):
    """A user-fixable problem. The message is one line: what is wrong, then how to fix it."""


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a CLI entry point; a :class:`DrcError` becomes one ``error:`` line and exit status 2."""
    try:
        return int(main(argv) or 0)
    except DrcError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
