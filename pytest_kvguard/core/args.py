"""Command-line parsing every ``kvguard SUBCOMMAND`` shares: a bad argument is one line.

In core so that every layer's command can use it: the ``cli`` commands and ``kvguard env``
(``isolation.environments``), which may not import ``cli``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


def usage_error(prog: str, message: str) -> str:
    """The one line (newline included) a command prints for a bad argument."""
    return f"{prog}: error: {message} (fix: see {prog} --help)\n"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, exit status 2, without the
    usage block: ``PROG: error: MESSAGE (fix: see PROG --help)``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(usage_error(self.prog, message))
        sys.exit(2)


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number at least ``minimum``, or a one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse
