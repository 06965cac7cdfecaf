"""The long texts a stream is fed: CPython's own pydoc topics by default, or a user's file."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.paths import resolve_under

DEFAULT_TEXT = "pydoc"


@dataclass(frozen=True)
class Text:
    """A named text and its content."""

    name: str
    content: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content.encode("utf-8")).hexdigest()


def pydoc_topics() -> Text:
    """CPython's ``pydoc_data.topics``, joined in key order: English prose and code, always there.

    The text differs between Python versions, so the report records its sha256.
    """
    from pydoc_data.topics import topics

    return Text(DEFAULT_TEXT, "\n\n".join(topics[key] for key in sorted(topics)))


def load_text(spec: str, base_dir: Path) -> Text:
    """``pydoc`` or a UTF-8 text file (relative to ``base_dir``)."""
    if spec == DEFAULT_TEXT:
        return pydoc_topics()
    path = resolve_under(spec, base_dir)
    try:
        return Text(spec, path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KvguardError(
            f"text file '{spec}' not found ({path})",
            fix=f"give an existing UTF-8 file, or '{DEFAULT_TEXT}' for the bundled text",
        ) from None
    except (UnicodeDecodeError, IsADirectoryError) as exc:
        raise KvguardError(f"text file '{spec}' is not UTF-8 text: {exc}") from None
