"""pytest-kvguard: a pytest plugin and CI regression gate for LLM KV-cache policies."""

from __future__ import annotations

__version__ = "0.1.0"
