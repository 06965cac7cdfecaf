"""What an engine entry point run in another interpreter needs (``kvguard-saved-cache``'s
writers and readers): a one-line error, and stdout kept for the one JSON result."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as the one line a table can quote: ``ValueError: too many values``."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def stdout_for_json() -> Iterator[Callable[[str], None]]:
    """Everything the engine prints goes to stderr; the JSON alone goes to stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)

    def emit(text: str) -> None:
        os.write(saved, text.encode())

    try:
        yield emit
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
