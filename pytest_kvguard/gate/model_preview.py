"""The model preview: every check on a model run a second time on a candidate file or folder.

``--kvguard-against-model NAME=PATH`` (ini ``kvguard_against_model``, budgets file
``against_models:``) names a model the checks use (a bundled name, or a path as the checks
write it) and the candidate that would replace it (a re-quantized GGUF, a re-exported one, an
mlx folder). Each check on NAME runs on both; the candidate's run is the check's row and is
judged against NAME's run with the baseline tolerances, as the upgrade preview judges a new
engine against the old. Before any run, the header lists the cache-relevant facts that differ
between the two (``model_facts``), read without loading weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pytest_kvguard.engines import ENGINES
from pytest_kvguard.errors import KvguardError
from pytest_kvguard.inputs.model_facts import (
    chat_token_line,
    diff_facts,
    diff_lines,
    read_model_facts,
)
from pytest_kvguard.inputs.models import ModelRef, parse_model
from pytest_kvguard.scenarios.base import Check


@dataclass(frozen=True)
class ModelSwap:
    """A model the checks use and the candidate previewed in its place."""

    model: str
    """The model as checks name it: a bundled name, or a path as the budgets file writes it."""
    candidate: ModelRef
    given: str
    """Where the swap was given (``--kvguard-against-model a=b``, ``budgets.yaml:12``), for
    messages."""


def parse_model_swaps(values: Iterable[str], written_as: str, base_dir: Path) -> list[ModelSwap]:
    """``["smollm2-135m=q8.gguf"]`` -> swaps; the candidate is read now (a file that is not a
    usable model is one line here, not a failed run later)."""
    swaps = []
    for value in values:
        model, sep, candidate = value.partition("=")
        given = f"{written_as} {value}"
        if not sep or not model.strip() or not candidate.strip():
            raise KvguardError(
                f"{given}: expected NAME=PATH",
                fix=f"write {written_as} smollm2-135m=path/to/candidate.gguf",
            )
        swaps.append(model_swap(model.strip(), candidate.strip(), base_dir, given))
    return swaps


def model_swap(model: str, candidate: str, base_dir: Path, given: str) -> ModelSwap:
    """One swap, its candidate checked to be a model kvguard can read."""
    try:
        ref = parse_model(candidate, base_dir)
        if ref.form in ("hub", "url"):
            raise KvguardError(
                f"a {ref.form} model cannot be previewed (its files are not here to compare)",
                fix="give a .gguf file or a model folder",
            )
        read_model_facts(ref.resolve())
    except KvguardError as exc:
        raise KvguardError(f"{given}: candidate {exc}", fix=None) from None
    return ModelSwap(model, ref, given)


def merge_swaps(
    command_line: Sequence[ModelSwap], budgets_file: Sequence[ModelSwap]
) -> list[ModelSwap]:
    """The command line's (or ini's) swaps over the budgets file's, model by model."""
    chosen = {swap.model: swap for swap in budgets_file}
    chosen.update({swap.model: swap for swap in command_line})
    return list(chosen.values())


def uses(check: Check[Any], swap: ModelSwap) -> bool:
    """Whether the check runs on the swap's model (by name, or by the file it resolves to)."""
    if check.model.name == swap.model:
        return True
    try:
        return check.model.form != "url" and _same_file(check.model.resolve(), swap.model)
    except KvguardError:
        return False


def _same_file(path: Path, written: str) -> bool:
    other = Path(written).expanduser()
    return other.exists() and path.exists() and path.resolve() == other.resolve()


def swap_for(check: Check[Any], swaps: Sequence[ModelSwap]) -> ModelSwap | None:
    return next((swap for swap in swaps if uses(check, swap)), None)


def check_swaps(swaps: Sequence[ModelSwap], checks: Sequence[Check[Any]]) -> None:
    """Every swap names a model some check uses; else one line naming the swap and the fix."""
    for swap in swaps:
        if not any(uses(check, swap) for check in checks):
            models = sorted({check.model.name for check in checks})
            raise KvguardError(
                f"{swap.given}: no check runs on model '{swap.model}'",
                fix="name a model the checks use: " + ", ".join(models),
            )


def not_previewed(check: Check[Any], swap: ModelSwap) -> str | None:
    """Why the check cannot run on the candidate (an engine that cannot load it), else None."""
    for engine in check.engines:
        if swap.candidate.form not in ENGINES[engine].model_forms:
            return (
                f"not previewed: engine {engine} cannot load a model {swap.candidate.form} "
                f"({swap.candidate.name})"
            )
    return None


def swapped(check: Check[Any], swap: ModelSwap) -> Check[Any]:
    """The check as it runs on the candidate."""
    return replace(check, model=swap.candidate)


@dataclass(frozen=True)
class FactsDiff:
    """What the header says and the JSON report keeps about one swap before any run."""

    model: str
    model_path: str
    candidate: str
    candidate_path: str
    differences: list[dict[str, str]]
    chat_tokens: str | None

    def lines(self) -> list[str]:
        """The header's lines: the swap, then one indented line per fact that differs."""
        facts = [f"{d['fact']}: {d['model']} -> {d['candidate']}" for d in self.differences]
        body = facts or diff_lines([])
        where = "" if self.candidate == self.candidate_path else f" ({self.candidate_path})"
        return [
            f"kvguard model preview: checks on {self.model} also run on {self.candidate}{where}",
            *(f"  {line}" for line in [*body, *([self.chat_tokens] if self.chat_tokens else [])]),
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_path": self.model_path,
            "candidate": self.candidate,
            "candidate_path": self.candidate_path,
            "differences": self.differences,
            "chat_tokens": self.chat_tokens,
        }


def facts_diff(swap: ModelSwap, checks: Sequence[Check[Any]]) -> FactsDiff:
    """The facts that differ between the swap's model (as the first check on it resolves it,
    else as its name resolves from the current directory) and the candidate."""
    using = next((check for check in checks if uses(check, swap)), None)
    model = using.model if using else parse_model(swap.model, Path.cwd())
    model_path, candidate_path = model.resolve(), swap.candidate.resolve()
    before, after = read_model_facts(model_path), read_model_facts(candidate_path)
    return FactsDiff(
        swap.model,
        str(model_path),
        swap.candidate.name,
        str(candidate_path),
        [
            {"fact": d.fact, "model": d.before, "candidate": d.after}
            for d in diff_facts(before, after)
        ],  # fmt: skip
        chat_token_line(before, after),
    )
