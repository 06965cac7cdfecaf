"""Scenarios: what a check does with an engine. They call the Engine protocol only."""

from __future__ import annotations

from pytest_kvguard.errors import KvguardError


def ascending_counts(
    values: object, what: str, minimum: int, at_least: int, example: str
) -> list[int]:
    """A list of at least ``at_least`` distinct integers >= ``minimum``, ascending, or an error."""
    if (
        not isinstance(values, (list, tuple))
        or len(values) < at_least
        or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values)
    ):
        raise KvguardError(
            f"{what} must be a list of at least {at_least} integers >= {minimum}, got {values!r}",
            fix=f"write e.g. {what}: {example}",
        )
    if list(values) != sorted(set(values)):
        raise KvguardError(
            f"{what} must be distinct and ascending, got {list(values)}",
            fix=f"write {what}: {sorted(set(values))}",
        )
    return list(values)
