"""Which Python runs each engine: ``--kvguard-engine-python`` and ``--kvguard-against`` (budgets
file ``engine_python:`` and ``against:``), read and merged. ``isolation.environments`` creates
the environments these name."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import engine_info

EVERY_ENGINE = "*"
"""The key of a bare ``--kvguard-against PATH``: every engine's other run is there."""
ENV_HELP = 'kvguard env "mlx-lm==0.28.0" prints the python of a cached environment for it'


def check_python(path: str, written_as: str) -> str:
    """An absolute interpreter path (symlinks kept: a venv's python is one), or a clear error."""
    absolute = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(absolute) or not os.access(absolute, os.X_OK):
        raise KvguardError(
            f"{written_as}: no Python interpreter at {absolute}",
            fix=f"pass the python of a virtual environment ({ENV_HELP})",
        )
    return absolute


def parse_assignments(
    values: Sequence[str], written_as: str, *, every_engine: bool = False
) -> dict[str, str]:
    """``["mlx=PATH"]`` -> ``{"mlx": "/abs/PATH"}``; a bare ``PATH`` (where ``every_engine``)
    stands for every engine."""
    chosen: dict[str, str] = {}
    for value in values:
        engine, sep, path = value.partition("=")
        if not sep:
            if not every_engine:
                raise KvguardError(
                    f"{written_as} {value!r} names no engine", fix=f"write {written_as} mlx=PATH"
                )
            engine, path = EVERY_ENGINE, value
        else:
            engine_info(engine)  # an unknown engine is refused with the known ones
        chosen[engine] = check_python(path, f"{written_as} {value}")
    return chosen


@dataclass(frozen=True)
class Environments:
    """Which interpreter runs each engine (absent: this one), and the preview's other run."""

    python: Mapping[str, str] = field(default_factory=dict)
    against: Mapping[str, str] = field(default_factory=dict)

    def python_for(self, engines: Sequence[str]) -> str:
        """The interpreter a check runs in: its engines share one worker."""
        chosen = {self.python.get(e, sys.executable) for e in engines}
        if len(chosen) > 1:
            raise KvguardError(
                f"engines {' and '.join(engines)} are set to run in different Python "
                "environments, and a check runs its engines in one worker",
                fix="give both engines the same --kvguard-engine-python, or neither",
            )
        return chosen.pop()

    def against_for(self, engines: Sequence[str]) -> tuple[str | None, str | None]:
        """The interpreter of the check's other run, or None and why there is none."""
        chosen = [self.against.get(e, self.against.get(EVERY_ENGINE)) for e in engines]
        if not any(chosen):
            return None, None
        lacking = [e for e, python in zip(engines, chosen, strict=True) if python is None]
        if lacking or len(set(chosen)) > 1:
            why = (f"{' and '.join(lacking)} has no --kvguard-against environment" if lacking
                   else "its engines have different --kvguard-against environments")  # fmt: skip
            return None, f"not previewed: {why}"
        return chosen[0], None


def engine_environments(
    command_line: Environments, budgets_file: Environments | None = None
) -> Environments:
    """Where each engine runs and the preview's other run: the command line (or ini) over the
    budgets file's ``engine_python:`` and ``against:``, engine by engine. The one place the two
    are merged (the budgets file's parser and the plugin both call it)."""
    if budgets_file is None:
        return command_line
    return Environments(
        {**budgets_file.python, **command_line.python},
        {**budgets_file.against, **command_line.against},
    )
