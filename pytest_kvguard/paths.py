"""Where a relative path in a budgets file or a test points."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache: where kvguard keeps what it builds and installs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def resolve_under(spec: str, base_dir: Path) -> Path:
    """``spec`` with ``~`` expanded; a relative one is taken from ``base_dir``."""
    path = Path(spec).expanduser()
    return path if path.is_absolute() else base_dir / path
