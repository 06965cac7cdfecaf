"""Where a relative path in a budgets file or a test points."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def user_cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache: where kvguard keeps what it builds and installs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def resolve_under(spec: str, base_dir: Path) -> Path:
    """``spec`` with ``~`` expanded; a relative one is taken from ``base_dir``."""
    path = Path(spec).expanduser()
    return path if path.is_absolute() else base_dir / path


def cached_per_file(read: Callable[[Path], T]) -> Callable[[Path], T]:
    """``read(path)`` computed once per version of the file: keyed by the path as given, its
    absolute path, size and modification time, so the same relative path seen from another
    directory, or a file rewritten in place, is read again (a plain ``functools.cache`` on
    the path would not).
    A path that cannot be stat'ed is passed through uncached, for ``read`` to report."""
    # The path as given is in the key too: what ``read`` returns may quote it.
    by_version: dict[tuple[Path, Path, int, int], T] = {}

    @functools.wraps(read)
    def cached(path: Path) -> T:
        try:
            stat = path.stat()
        except OSError:
            return read(path)
        key = (path, path.resolve(), stat.st_size, stat.st_mtime_ns)
        if key not in by_version:
            by_version[key] = read(path)
        return by_version[key]

    return cached
