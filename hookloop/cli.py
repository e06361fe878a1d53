"""The ``hookloop`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hookloop`` console script.

    Commands:
        ``hookloop version``: print the versions of hookloop and torch.
        ``hookloop events``: print the events in firing order with what each guarantees.
    """
    parser = argparse.ArgumentParser(prog="hookloop", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the versions of hookloop and torch")
    commands.add_parser("events", help="print the loop's events in firing order")
    args = parser.parse_args(argv)
    if args.command == "version":
        import torch

        import hookloop

        print(f"hookloop {hookloop.__version__} (torch {torch.__version__})")
    elif args.command == "events":
        from hookloop.events import Event

        print(Event.__doc__)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
