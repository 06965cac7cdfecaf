"""The core layer: errors, units, paths, scoring, cache policies and budgets. It imports no
other kvguard package; every other layer builds on it (see docs/contributing.md)."""
