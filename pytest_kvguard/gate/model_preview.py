"""The model preview: every check on a model run a second time on a candidate file or folder.

``--kvguard-against-model NAME=PATH`` (ini ``kvguard_against_model``, budgets file
``against_models:``) names a model the checks use (a bundled name, or its file or folder,
matched to the checks by the file it resolves to) and the candidate that would replace it (a
re-quantized GGUF, a re-exported one, an mlx folder). Each check on NAME runs on both; the
candidate's run is the check's row and is judged against NAME's run with the baseline
tolerances, as the upgrade preview judges a new engine against the old. Before any run, the
header lists the cache-relevant facts that differ between the two (``model_facts``), read
without loading weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import ENGINES
from pytest_kvguard.engines.chat_tokens import chat_token_line
from pytest_kvguard.inputs.model_facts import (
    FactDifference,
    diff_facts,
    diff_lines,
    read_model_facts,
)
from pytest_kvguard.inputs.models import ModelRef, parse_model
from pytest_kvguard.scenarios.base import Check


@dataclass(frozen=True)
class SwapSpec:
    """A swap as written, before either side is read."""

    model: str
    candidate: str
    base_dir: Path
    """Where relative paths start: the current directory (command line), rootdir (ini), the
    budgets file's folder (``against_models:``)."""
    given: str
    """Where it was written (``--kvguard-against-model a=b``, ``budgets.yaml:12:
    against_models``), for messages."""
    from_budgets_file: bool = False


@dataclass(frozen=True)
class ModelSwap:
    """A model the checks use and the candidate previewed in its place."""

    model: str
    """The model as the swap names it: a bundled name, or a path as written."""
    model_path: Path
    """The file or folder ``model`` names, resolved from the spec's ``base_dir``, absolute."""
    candidate: ModelRef
    candidate_architecture: str | None
    """The candidate GGUF's ``general.architecture``; None for a folder."""
    given: str
    from_budgets_file: bool = False
    """A budgets file's standing swap: a run that selects no check on its model (``-k``) is
    not a preview that compared nothing."""


def parse_model_swaps(values: Iterable[str], written_as: str, base_dir: Path) -> list[SwapSpec]:
    """``["smollm2-135m=q8.gguf"]`` -> specs (``model_swaps`` reads them)."""
    specs = []
    for value in values:
        model, sep, candidate = value.partition("=")
        given = f"{written_as} {value}"
        if not sep or not model.strip() or not candidate.strip():
            raise KvguardError(
                f"{given}: expected NAME=PATH",
                fix=f"write {written_as} smollm2-135m=path/to/candidate.gguf",
            )
        specs.append(SwapSpec(model.strip(), candidate.strip(), base_dir, given))
    return specs


def model_swaps(
    command_line: Sequence[SwapSpec], budgets_file: Sequence[SwapSpec]
) -> list[ModelSwap]:
    """The command line's (or ini's) swaps over the budgets file's, model file by model file
    (however each spells the model); then each kept candidate read (a file that is not a
    usable model is one line now, not a failed run later). A budgets-file candidate that the
    command line overrides is never read."""
    chosen: dict[Path, SwapSpec] = {}
    for spec in command_line:
        path = _model_path(spec)
        if path in chosen:
            raise KvguardError(
                f"{spec.given}: model {path} already has a candidate ({chosen[path].given})",
                fix="give one candidate per model",
            )
        chosen[path] = spec
    for spec in budgets_file:
        chosen.setdefault(_model_path(spec), spec)
    return [model_swap(spec, path) for path, spec in chosen.items()]


def _model_path(spec: SwapSpec) -> Path:
    try:
        ref = parse_model(spec.model, spec.base_dir)
    except KvguardError as exc:
        raise KvguardError(f"{spec.given}: {exc}", fix=None) from None
    return _local_files(ref, "model", spec.given).resolve()


def model_swap(spec: SwapSpec, model_path: Path) -> ModelSwap:
    """One swap: the candidate a local file or folder kvguard can read, not the model's own."""
    try:
        candidate = parse_model(spec.candidate, spec.base_dir)
    except KvguardError as exc:
        raise KvguardError(f"{spec.given}: candidate {exc}", fix=None) from None
    candidate_path = _local_files(candidate, "candidate", spec.given)
    if candidate_path.resolve() == model_path:
        raise KvguardError(
            f"{spec.given}: the candidate is {spec.model}'s own file ({model_path}): the "
            "preview would compare the model with itself",
            fix="give the new file (kvguard quantize writes one)",
        )
    try:
        facts = read_model_facts(candidate_path)
    except KvguardError as exc:
        raise KvguardError(f"{spec.given}: candidate {exc}", fix=None) from None
    architecture = facts.architecture if candidate.form == "gguf" else None
    return ModelSwap(spec.model, model_path, candidate, architecture, spec.given,
                     spec.from_budgets_file)  # fmt: skip


def _local_files(ref: ModelRef, side: str, given: str) -> Path:
    """The model's file or folder; a hub id or a server's URL is refused: the preview reads
    both sides' files before any run, and those are not here."""
    if ref.form in ("hub", "url"):
        what = "a hub id" if ref.form == "hub" else "a server's URL"
        raise KvguardError(
            f"{given}: {side} '{ref.name}' is {what}: a model preview reads both models' "
            "files, and those are not here",
            fix="give a bundled model name, a .gguf file or a model folder on this machine",
        )
    try:
        return ref.resolve()
    except KvguardError as exc:  # a bundled model that is not installed
        raise KvguardError(f"{given}: {side} {exc}", fix=None) from None


def uses(check: Check[Any], swap: ModelSwap) -> bool:
    """Whether the check runs on the swap's model: the file or folder its model resolves to
    (a bundled name resolves to the installed file)."""
    if check.model.form not in ("gguf", "folder"):
        return False
    try:
        return check.model.resolve().resolve() == swap.model_path
    except KvguardError:
        return False  # the check's own run says why its model is missing


def swap_for(check: Check[Any], swaps: Sequence[ModelSwap]) -> ModelSwap | None:
    return next((swap for swap in swaps if uses(check, swap)), None)


def check_swaps(swaps: Sequence[ModelSwap], checks: Sequence[Check[Any]]) -> None:
    """Every swap names a model some check uses; else one line naming the swap and the fix."""
    for swap in swaps:
        if not any(uses(check, swap) for check in checks):
            models = sorted({check.model.name for check in checks})
            raise KvguardError(
                f"{swap.given}: no check runs on model '{swap.model}' ({swap.model_path})",
                fix="name a model the checks use: " + ", ".join(models),
            )


def not_previewed(check: Check[Any], swap: ModelSwap) -> str | None:
    """Why the check cannot run on the candidate (an engine that cannot load its form or, by
    what the engine declares, its architecture), else None."""
    for engine in check.engines:
        info = ENGINES[engine]
        if swap.candidate.form not in info.model_forms:
            return (
                f"not previewed: engine {engine} cannot load a model {swap.candidate.form} "
                f"({swap.candidate.name})"
            )
        known, arch = info.gguf_architectures, swap.candidate_architecture
        if known is not None and arch is not None and arch not in known:
            return (
                f"not previewed: engine {engine} cannot load GGUF architecture '{arch}' "
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
    differences: list[FactDifference]
    chat_tokens: str | None
    from_budgets_file: bool = False
    """As ``ModelSwap.from_budgets_file``."""
    compared_checks: int | None = None
    """How many checks were judged on the candidate; set at session end."""

    def lines(self) -> list[str]:
        """The header's lines: the swap, then one indented line per fact that differs."""
        body = diff_lines(self.differences)
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
            "differences": [
                {"fact": d.fact, "model": d.before, "candidate": d.after} for d in self.differences
            ],
            "chat_tokens": self.chat_tokens,
            "compared_checks": self.compared_checks,
        }


def facts_diff(swap: ModelSwap) -> FactsDiff:
    """The facts that differ between the swap's model and the candidate."""
    candidate_path = swap.candidate.resolve()
    before, after = read_model_facts(swap.model_path), read_model_facts(candidate_path)
    return FactsDiff(
        swap.model,
        str(swap.model_path),
        swap.candidate.name,
        str(candidate_path),
        diff_facts(before, after),
        chat_token_line(before, after),
        swap.from_budgets_file,
    )
