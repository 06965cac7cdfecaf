"""Checks shared by scenarios' ``build``: each refuses a setting that could not mean what it
says, with an error keyed to the setting."""

from __future__ import annotations

from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.scenarios.base import Fields


def require_two_engines(fields: Fields, scenario: str, what: str) -> None:
    """A two-engine scenario naming one engine twice would compare a run with itself."""
    if fields.engines[0] == fields.engines[1]:
        raise KvguardError(
            f"{scenario} compares two engines, and both are '{fields.engine}': it would "
            f"compare {what} with itself",
            fix="write engines: [llama_cpp, mlx]",
            key="engines",
        )


def require_text_room(fields: Fields, tokens: int, key: str) -> None:
    """Refuse a token count the text cannot hold: every token covers at least one byte."""
    text = fields.loaded_text
    size = len(text.content.encode("utf-8"))
    if tokens > size + 1:  # + BOS
        raise KvguardError(
            f"{key.removeprefix('params.')} {tokens} is more than text '{text.name}' can give "
            f"({size:,} bytes, so at most {size + 1:,} tokens)",
            fix="lower it, or use a longer text",
            key=key,
        )


def ascending_counts(
    values: object, what: str, minimum: int, at_least: int, example: str
) -> list[int]:
    """A list of at least ``at_least`` distinct integers >= ``minimum``, ascending, or an error."""
    key = f"params.{what}"
    if (
        not isinstance(values, (list, tuple))
        or len(values) < at_least
        or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values)
    ):
        raise KvguardError(
            f"{what} must be a list of at least {at_least} integers >= {minimum}, got {values!r}",
            fix=f"write e.g. {what}: {example}",
            key=key,
        )
    if list(values) != sorted(set(values)):
        raise KvguardError(
            f"{what} must be distinct and ascending, got {list(values)}",
            fix=f"write {what}: {sorted(set(values))}",
            key=key,
        )
    return list(values)


def check_bounded_run(policy: Policy, tokens: int, budgets: Budgets) -> None:
    """``bounded: true`` needs a cap and a run that goes past it, or it proves nothing."""
    if not budgets.bounded:
        return
    if policy.cap is None or tokens <= policy.cap:
        raise KvguardError(
            "bounded needs a policy with a cap and a run that goes past it"
            if policy.cap is None
            else f"bounded: the run ({tokens} tokens) never goes past the cap {policy.cap}",
            fix="use window, sink or engine_default with a cap below the tokens fed",
            key="budgets.bounded",
        )


def check_sinks(values: object, cap: int | None) -> tuple[int, ...]:
    """sweep's ``sinks``: at least two distinct sink counts, ascending, each leaving room
    under the cap."""
    counts = ascending_counts(values, "sinks", 0, 2, "[0, 1, 2, 4, 8]")
    if cap is not None and counts[-1] >= cap - 1:
        raise KvguardError(
            f"{counts[-1]} sinks leave no room under cap {cap}",
            fix="raise cap or drop that count",
            key="params.sinks",
        )
    return tuple(counts)
