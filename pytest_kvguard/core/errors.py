"""Errors that reach the user as one line: where, what, and how to fix it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class KvguardError(Exception):
    """Any problem the user can fix: bad budgets file, unknown model, engine not installed.

    The plugin prints ``str(error)`` alone, never a traceback.
    """

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        path: str | Path | None = None,
        line: int | None = None,
        key: str | None = None,
    ) -> None:
        self.message = message
        self.fix = fix
        self.path = str(path) if path is not None else None
        self.line = line
        self.key = key
        """The check key at fault (``policy``, ``params.cap``, ``budgets.bounded``), so a
        parser can point at its line; None when the check as a whole is at fault."""
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.path is not None:
            where = f"{self.path}:{self.line}: " if self.line is not None else f"{self.path}: "
        fix = f" (fix: {self.fix})" if self.fix else ""
        return f"{where}{self.message}{fix}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (an engine worker sends it to the pytest process), not as str(self).
        return (_restore, (type(self), self.message, self.fix, self.path, self.line, self.key))

    def keyed(self, key: str) -> KvguardError:
        """The same error, pointing at check key ``key`` unless it already points somewhere."""
        if self.key is not None:
            return self
        return KvguardError(self.message, fix=self.fix, path=self.path, line=self.line, key=key)

    def located(self, path: str | Path, line: int | None) -> KvguardError:
        """The same error, pinned to a place in a file when it has none yet."""
        if self.path is not None:
            return self
        return KvguardError(self.message, fix=self.fix, path=path, line=line, key=self.key)


def _restore(
    cls: type[KvguardError],
    message: str,
    fix: str | None,
    path: str | None,
    line: int | None,
    key: str | None,
) -> KvguardError:
    return cls(message, fix=fix, path=path, line=line, key=key)


class EngineError(KvguardError):
    """The engine refused an operation or behaved against its own contract."""


class EngineRefusal(EngineError):
    """The engine refused a combination of settings it does not implement (mlx-lm quantizing a
    ``RotatingKVCache``): a fact about the engine to report as one line, not a fault."""
