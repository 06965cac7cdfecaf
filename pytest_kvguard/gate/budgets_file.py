"""The budgets file: a versioned YAML list of checks, validated with file:line errors.

Schema (version 1)::

    version: 1
    defaults:            # optional; merged under every check (params and budgets key by key)
      engine: llama_cpp
      model: smollm2-135m
    checks:
      - name: smollm2-sink4          # unique; becomes the pytest item name
        scenario: stream             # default: stream
        engine: llama_cpp
        model: smollm2-135m          # bundled name, or a .gguf path (relative to this file)
        policy: sink                 # full | window | sink | ...
        baseline: full               # the policy the delta is measured against (default: full)
        params: {tokens: 1500, cap: 256, sinks: 4, positions: reindexed, evict_step: 1, text: pydoc}
        budgets: {max_ppl_increase_pct: 25, max_post_eviction_ppl: 14}
        expect: pass                 # or "violation": a negative control that must break a budget
        reason: why a violation is expected (required with expect: violation)
    baseline_tolerances:   # optional; with --kvguard-baseline: how far a figure may regress
      post_eviction_ppl: 2%          # may rise 2%; a number: by that much; exact: not change
    engine_python:         # optional: run an engine in another virtual environment
      mlx: envs/mlx-0.28/bin/python  # relative to this file; kvguard env prints one
    against:               # optional: upgrade preview, every check run here and there
      mlx: envs/mlx-0.28/bin/python  # or one path for every engine
    against_models:        # optional: model preview, every check on a model run on a candidate
      smollm2-135m: models/smollm2-q8_0.gguf   # relative to this file; a .gguf or a folder

Each check is built by ``checks.build_check``, the same validation a fixture call goes through.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pytest_kvguard.core.budgets import unknown_key_error
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import engine_info
from pytest_kvguard.gate.baseline import Tolerance, parse_tolerance, tolerances
from pytest_kvguard.gate.checks import DEFAULT_KEYS, Written, build_check
from pytest_kvguard.gate.engine_pythons import (
    EVERY_ENGINE,
    Environments,
    check_python,
    engine_environments,
)
from pytest_kvguard.gate.model_preview import SwapSpec
from pytest_kvguard.scenarios.base import Check

SCHEMA_VERSION = 1
TOP_KEYS = [
    "version", "defaults", "checks", "baseline_tolerances", "engine_python", "against",
    "against_models",
]  # fmt: skip
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _LineLoader(yaml.SafeLoader):
    """Builds every mapping as a ``Written`` that knows its line and each key's."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping = Written(super().construct_mapping(node, deep=True))
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {
            self.construct_object(key, deep=True): key.start_mark.line + 1 for key, _ in node.value
        }
        return mapping


_LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _LineLoader.construct_mapping
)


@dataclass(frozen=True)
class BudgetsFile:
    path: Path
    sha256: str
    checks: tuple[Check[Any], ...]
    baseline_tolerances: dict[str, Tolerance] = field(default_factory=lambda: tolerances({}))
    """How far each figure may move against --kvguard-baseline (defaults + the file's own)."""
    environments: Environments = field(default_factory=Environments)
    """The file's own ``engine_python:`` (engine -> the interpreter of the environment it runs
    in) and ``against:`` (engine or ``*`` -> the upgrade preview's other run), before the
    command line's (``engine_environments`` puts those over these)."""
    model_swaps: tuple[SwapSpec, ...] = ()
    """The file's ``against_models:`` (model -> candidate) as written, before the command
    line's (``model_preview.model_swaps`` reads them)."""


def load_budgets_file(path: Path, command_line: Environments | None = None) -> BudgetsFile:
    """Parse and validate a budgets file; every problem is a KvguardError naming file and line.
    Engines given an environment (on the ``command_line`` or in the file's ``engine_python:``)
    run in another environment and need not be installed in this one."""
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise KvguardError(
            f"cannot read budgets file: {exc.strerror}", path=path, fix="pass an existing YAML file"
        ) from None
    try:
        document = yaml.load(raw_bytes.decode("utf-8"), Loader=_LineLoader)  # noqa: S506
    except UnicodeDecodeError:
        raise KvguardError("budgets file is not UTF-8 text", path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise KvguardError(
            f"malformed YAML: {problem}",
            path=path,
            line=mark.line + 1 if mark else None,
            fix="check indentation, colons and quoting on this line",
        ) from None
    if not isinstance(document, Written):
        raise KvguardError(
            "a budgets file must be a mapping with 'version' and 'checks'",
            path=path,
            line=1,
            fix="start the file with 'version: 1' and a 'checks:' list",
        )
    _reject_unknown(document, TOP_KEYS, "top-level key", path)
    version = document.get("version")
    if version != SCHEMA_VERSION:
        raise KvguardError(
            f"unsupported budgets file version {version!r}",
            path=path,
            line=document.key_lines.get("version", document.line),
            fix=f"set version: {SCHEMA_VERSION}",
        )
    defaults = document.get("defaults") or Written()
    if not isinstance(defaults, Written):
        raise _not_a_mapping("defaults", defaults, path, document.key_lines["defaults"])
    _reject_unknown(defaults, DEFAULT_KEYS, "defaults key", path)
    entries = document.get("checks")
    if not isinstance(entries, list) or not entries:
        raise KvguardError(
            "'checks' must be a non-empty list",
            path=path,
            line=document.key_lines.get("checks", document.line),
            fix="add at least one check under 'checks:'",
        )
    engine_python = _pythons(document, "engine_python", path)
    elsewhere = frozenset(
        engine_environments(command_line or Environments(), Environments(engine_python)).python
    )
    checks: list[Check[Any]] = []
    seen: dict[str, int | None] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, Written):
            raise KvguardError(
                f"check #{index + 1} must be a mapping",
                path=path,
                line=document.key_lines["checks"],
            )
        name = entry.get("name")
        if isinstance(name, str) and not NAME_PATTERN.match(name):
            raise KvguardError(
                f"check name '{name}' has characters pytest ids cannot carry",
                path=path,
                line=entry.key_lines.get("name", entry.line),
                fix="use letters, digits, '.', '_' and '-'",
            )
        check = build_check(
            entry, defaults, base_dir=path.parent, path=path, where=f"{path}:{entry.line}",
            installed_elsewhere=elsewhere,
        )  # fmt: skip
        if check.name in seen:
            raise KvguardError(
                f"duplicate check name '{check.name}' (first on line {seen[check.name]})",
                path=path,
                line=entry.line,
                fix="give every check a unique name",
            )
        seen[check.name] = entry.line
        checks.append(check)
    return BudgetsFile(
        path,
        hashlib.sha256(raw_bytes).hexdigest(),
        tuple(checks),
        _baseline_tolerances(document, path),
        Environments(engine_python, _pythons(document, "against", path)),
        _model_swaps(document, path),
    )


def _model_swaps(document: Written, path: Path) -> tuple[SwapSpec, ...]:
    """``against_models:``: model as the checks name it -> candidate, relative to the file."""
    key = "against_models"
    section = document.get(key)
    if section is None:
        return ()
    if not isinstance(section, Written):
        raise _not_a_mapping(key, section, path, document.key_lines[key])
    swaps = []
    for model, candidate in section.items():
        line = section.key_lines.get(model, document.key_lines[key])
        if not isinstance(candidate, str):
            raise KvguardError(
                f"{key}.{model} must be a path, got {candidate!r}", path=path, line=line,
                fix="write the candidate's .gguf file or model folder",
            )  # fmt: skip
        given = f"{path}:{line}: {key}"
        swaps.append(SwapSpec(str(model), candidate, path.parent, given, from_budgets_file=True))
    return tuple(swaps)


def _pythons(document: Written, key: str, path: Path) -> dict[str, str]:
    """``engine_python:`` / ``against:``: engine -> interpreter path, relative to the file.
    ``against:`` may also be one path, for every engine."""
    section = document.get(key)
    if section is None:
        return {}
    line = document.key_lines[key]
    if isinstance(section, str) and key == "against":
        section = Written({EVERY_ENGINE: section})
        section.key_lines = {EVERY_ENGINE: line}
    if not isinstance(section, Written):
        raise _not_a_mapping(key, section, path, line)
    chosen = {}
    for engine, python in section.items():
        where = section.key_lines.get(engine, line)
        try:
            if engine != EVERY_ENGINE:
                engine_info(str(engine))
            if not isinstance(python, str):
                raise KvguardError(f"{key}.{engine} must be a path, got {python!r}")
            chosen[str(engine)] = check_python(str(path.parent / python), f"{key}.{engine}")
        except KvguardError as exc:
            raise exc.located(path, where) from None
    return chosen


def _baseline_tolerances(document: Written, path: Path) -> dict[str, Tolerance]:
    """The ``baseline_tolerances:`` section: how far each figure may move against a saved run."""
    key = "baseline_tolerances"
    section = document.get(key) or Written()
    if not isinstance(section, Written):
        raise _not_a_mapping(key, section, path, document.key_lines[key])
    declared: dict[str, object] = {}
    for metric, raw in section.items():
        try:
            parse_tolerance(str(metric), raw)
        except KvguardError as exc:
            raise exc.located(path, section.key_lines[metric]) from None
        declared[str(metric)] = raw
    return tolerances(declared)


def _reject_unknown(mapping: Written, known: list[str], kind: str, path: Path) -> None:
    for key in mapping:
        if key not in known:
            raise unknown_key_error(kind, str(key), known).located(path, mapping.key_lines[key])


def _not_a_mapping(key: str, value: Any, path: Path, line: int) -> KvguardError:
    return KvguardError(
        f"{key} must be a mapping, got {value!r}", path=path, line=line,
        fix=f"write {key} as a mapping",
    )  # fmt: skip
