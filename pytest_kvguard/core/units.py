"""Units in one place: sizes ("6 MiB") and numbers as budgets, tables and messages show them."""

from __future__ import annotations

from pytest_kvguard.core.errors import KvguardError

SIZE_UNITS = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}
SIZE_SUFFIXES = (" B", " B/token")
"""Units of figures given in bytes: their budgets accept sizes such as "6 MiB"."""


def format_size(n_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: ``5.60 MiB``, ``23.00 KiB``."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = SIZE_UNITS[unit]
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:,.2f} {unit}"
    return f"{n_bytes:,.0f} B"


def parse_size(text: str, name: str) -> float:
    """``"24 MiB"`` -> 25165824.0; binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units."""
    number, _, unit = text.strip().partition(" ")
    try:
        return float(number) * SIZE_UNITS[unit.strip() or "B"]
    except (ValueError, KeyError):
        raise KvguardError(
            f"budget {name} must be a size, got {text!r}",
            fix=f"write e.g. {name}: 24 MiB (units: {', '.join(SIZE_UNITS)})",
        ) from None


def format_value(value: float, unit: str = "") -> str:
    """A figure with its unit: sizes in binary units, whole numbers without decimals."""
    if unit in SIZE_SUFFIXES:
        return format_size(value) + unit[2:]
    text = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    return text + unit


def format_figure(value: float) -> str:
    """A figure in a message: whole numbers with separators, others to 4 significant digits."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"


def format_change(old: float, new: float) -> str:
    """``+5.00%`` (relative), or the absolute step where the old value is 0."""
    if old:
        return f"{(new / old - 1) * 100:+.2f}%"
    step = new - old
    return ("+" if step >= 0 else "-") + format_figure(abs(step))


def mib(n_bytes: float, digits: int = 1) -> str:
    """``94.7 MiB``: the compact form tables use."""
    return f"{n_bytes / 2**20:,.{digits}f} MiB"
