"""Where a relative path in a budgets file or a test points."""

from __future__ import annotations

from pathlib import Path


def resolve_under(spec: str, base_dir: Path) -> Path:
    """``spec`` with ``~`` expanded; a relative one is taken from ``base_dir``."""
    path = Path(spec).expanduser()
    return path if path.is_absolute() else base_dir / path
