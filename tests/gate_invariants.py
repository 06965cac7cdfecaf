"""What must hold of a gate run's JSON report, whichever budgets file it ran: the quick gate and
the full bundled gate, whose reports .ci/run and .ci/nightly check (check_gate_report.py), and
the test suite's short real runs (test_scenarios_on_engines.py).

Each check row is judged against the check it came from: its verdict is the one the file
expects, and its figures agree with each other and with the check's parameters (counts the
engines report exactly). Pairs of checks that must agree across engines are matched by name;
README's quoted tables are compared with the tables the report renders.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_kvguard.gate.budgets_file import load_budgets_file
from pytest_kvguard.gate.outcome import row_from_json
from pytest_kvguard.gate.report import render_table
from pytest_kvguard.scenarios.base import Check

ROOT = Path(__file__).resolve().parent.parent
FULL = ROOT / "fixtures" / "budgets.yaml"
QUICK = ROOT / "fixtures" / "quick.yaml"


def check_names(path: Path) -> list[str]:
    """A budgets file's check names in file order, read as plain YAML: no engine is needed for
    this, so a test module can parametrize over them at import on any machine."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [entry["name"] for entry in document["checks"]]


@cache
def checks_by_name(path: Path) -> dict[str, Check[Any]]:
    """A budgets file's checks, parsed in full, by name. The parser refuses a check whose engine
    is not installed: call it inside a test that carries those engines' markers, never at
    import (a machine without one would get a collection error, not a skip or a failure)."""
    return {check.name: check for check in load_budgets_file(path).checks}


def expected_verdict(check: Check[Any]) -> str:
    return "CAUGHT" if check.expect_violation else "PASS"


def assert_row_holds(row: Mapping[str, Any], check: Check[Any]) -> None:
    """The row's verdict is the expected one and its figures are consistent with the check."""
    assert row["verdict"] == expected_verdict(check), (row["name"], row.get("violations"),
                                                       row.get("error"))  # fmt: skip
    m, spec, detail = row["metrics"], check.spec, row["detail"]
    if check.scenario == "edit_replay":
        # The engine may keep no more than the common prefix, and always re-prefills one token.
        assert m["reused_tokens"] <= min(m["split"], m["prompt_tokens"] - 1)
        assert m["reused_tokens"] + m["reprefill_tokens"] == m["prompt_tokens"]
        if spec.reply_tokens:
            # Scored against a fresh prefill and a floor: 0 where nothing was reused (no cut).
            assert m["scored_tokens"] == spec.reply_tokens
            assert m["reuse_excess"] == pytest.approx(m["mean_abs_nll_diff"] - m["reuse_floor"])
            assert m["reused_tokens"] > 0 or m["reuse_floor"] == 0
        if spec.stale_window:
            # A stale control stays stale: part of the kept prefix's window was gone.
            assert m["window_missing_tokens"] > 0 and m["reused_tokens"] > 0
        if (
            spec.policy.kind in ("full", "swa_full")
            and check.engine != "mlx"
            # the one finding: LlamaDiskCache pops the state it finds, so it does not come back
            and spec.api_state != "disk"
        ):
            # Nothing slides out of these caches: the whole common prefix is reused.
            assert m["reused_tokens"] == min(m["split"], m["prompt_tokens"] - 1)
        return
    if check.scenario == "speculative":
        if m["refused"]:
            # Only a cache already past its cap may be refused, and nothing was emitted.
            assert spec.prefilled > 0 and detail["refused"], row["name"]
            return
        # Drafts were made and some rejected (no hollow pass); a divergence is counted only
        # where it is one, and the gap is judged against twice the measured noise.
        assert m["drafted"] > 0 and m["accepted"] <= m["drafted"]
        assert m["rejections_past_cap"] > 0
        assert 0 <= m["divergent_tokens_past_noise"] <= m["divergent_tokens"] <= spec.new_tokens
        if "logprob_gap" in m:  # absent where the engine reports no log p (llama-server)
            excess = m["logprob_gap"] - 2 * m["noise_logprob"]
            assert m["logprob_gap_excess"] == pytest.approx(excess)
        assert (detail["first_divergence"] is None) == (m["divergent_tokens"] == 0)
        return
    if check.scenario == "memory":
        # Every length reached; a cap holds exactly min(n, cap) entries (the engine's count).
        samples = detail["samples"]
        assert [s["tokens"] for s in samples] == list(spec.lengths)
        if spec.policy.kind in ("sink", "window"):
            assert [s["held"] for s in samples] == [min(n, spec.policy.cap) for n in spec.lengths]
        return
    if check.scenario == "sweep":
        # One run per sink count and position handling asked for, no more, no fewer.
        grid = sorted((s["positions"], s["sinks"]) for s in detail["samples"])
        assert grid == sorted((p, n) for p in spec.positions for n in spec.sinks)
        # Every run held exactly the cap once past it, and evicted from the same token on.
        assert {s["kv_entries"] for s in detail["samples"]} == {spec.cap}
        assert {s["first_eviction"] for s in detail["samples"]} == {spec.cap}
        return
    if check.scenario == "recall":
        assert m["baseline_recalled"] == 1  # the full cache answers: the probe is answerable
        # Eviction reaches the fact unless every fact token is a pinned sink.
        evicts = spec.policy.kind != "full"
        assert m["fact_evicted"] == (evicts and spec.policy.sinks < m["fact_tokens"])
        return
    if check.scenario == "generate":
        # Reply tokens past the cap were scored against both comparison runs (a server has no
        # decode loop of kvguard's to compare with: its chunk gap is not measured).
        assert m["scored_tokens"] > 0
        served = check.engine == "llama_server"
        assert ("single_token_post_eviction_ppl" in m) != served
        assert math.isfinite(m["post_eviction_ppl"])
        return
    if check.scenario == "parity":
        assert row["tokens"] == spec.tokens and m["mean_abs_nll_diff"] > 0
        return
    if check.scenario == "attention":
        # Every row read is a probability distribution, for every query asked, on every layer.
        assert m["max_row_sum_error"] < 1e-3
        assert detail["queries"] == list(spec.queries)
        assert len(detail["head_mass_by_k"]) == len(detail["layer_sink_mass"]) > 0
        by_k = detail["sink_mass_by_k"]  # mass on the first k tokens grows with k
        assert all(a <= b + 1e-6 for a, b in zip(by_k, by_k[1:], strict=False))
        return
    if check.scenario == "attention_parity":
        assert 0 < m["mean_sink_mass_diff_pct"] <= m["sink_mass_diff_pct"]
        return
    assert check.scenario == "stream", check.scenario
    if m.get("engine_refused"):
        # The engine's refusal is the check's first finding, in one line; nothing was measured.
        assert row["violations"][0].startswith("engine refused: ")
        assert math.isnan(m["post_eviction_ppl"])
        return
    if spec.policy.precision_set:
        # A quantized cache's bytes are reported beside their prediction, and the deviation is
        # the one those two make (finite: a prediction of 0 bytes or a NaN cannot pass), within
        # the check's budget for it where the check is not a negative control.
        assert "kv_bytes_predicted" in m, row["name"]
        predicted, deviation = m["kv_bytes_predicted"], m["kv_deviation_pct"]
        assert predicted > 0 and m["kv_bytes"] > 0 and math.isfinite(deviation)
        assert deviation == pytest.approx(abs(m["kv_bytes"] / predicted - 1.0) * 100.0)
        budget = check.budgets.max_kv_deviation_pct
        if budget is not None and not check.expect_violation:
            assert deviation <= budget, (row["name"], deviation, budget)
    if spec.policy.precision_set and spec.policy.cap is None:
        return  # a quantized full cache: nothing evicts
    if row["violations"] and spec.policy.kind in ("sink", "window") and not spec.policy.quantized:
        # A red sink or window check names the heads that park attention on the first tokens.
        explanation = row["explanation"]
        assert explanation is not None
        assert explanation["sinks_kept"] == spec.policy.sinks
        assert explanation["sink_heads"]
    cap = spec.policy.cap
    assert cap is not None
    if spec.policy.kind in ("sink", "window"):
        assert m["first_eviction"] == cap  # token `cap` is the first that does not fit
        assert m["kv_entries"] == cap
        assert m["evicted"] == spec.tokens - cap
        # A chunked run is compared with the same policy fed one token at a time.
        assert ("chunk_gap_pct" in m) == (spec.policy.chunk > 1)
        # Before the first eviction every policy holds the same tokens: only batching differs
        # (and a quantized cache's precision, from the first token on).
        if not spec.policy.quantized:
            assert m["pre_eviction_ppl"] == pytest.approx(m["baseline_pre_eviction_ppl"], rel=2e-3)
    elif spec.policy.kind == "engine_default":
        # The finding: the cap was asked for and not applied (some layers keep every token).
        assert m["kv_entries"] == spec.tokens > cap


@dataclass(frozen=True)
class Agreement:
    """Two checks of one file whose figures must agree (the same chat, ids and policy through
    two engines); ``why`` says what is compared."""

    first: str
    second: str
    why: str


SERVED_AND_IN_PROCESS = (
    ("smollm2-server-full-edit-start", "smollm2-full-edit-start"),
    ("smollm2-server-full-edit-end", "smollm2-full-edit-end"),
    ("gemma3-server-swa-edit-end", "gemma3-swa-edit-end"),
    ("gemma3-server-swa-append", "gemma3-swa-append"),
    ("gemma3-server-swafull-edit-middle", "gemma3-swafull-edit-middle"),
)
"""The same chat, follow-up and token ids: llama-server's own cache_n and prompt_n are the
in-process engine's reused and re-prefilled counts, token for token."""


def assert_served_counts_equal(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every served edit-replay check beside its in-process twin, where both ran; the pairs
    compared."""
    compared = []
    keys = ("prompt_tokens", "split", "reused_tokens", "reprefill_tokens")
    for served, in_process in SERVED_AND_IN_PROCESS:
        if served in rows and in_process in rows:
            a, b = rows[served]["metrics"], rows[in_process]["metrics"]
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (served, in_process)
            compared.append(served)
    return compared


def assert_server_checkpoints_differ(rows: Mapping[str, Mapping[str, Any]]) -> None:
    """The one count that differs: llama-server checkpoints only near a prompt's end, so the
    middle edit starts over where the in-process engine restores a checkpoint."""
    server = rows["gemma3-server-ckpt-edit-middle"]["metrics"]
    in_process = rows["gemma3-ckpt-edit-middle"]["metrics"]
    assert server["reused_tokens"] == 0 < in_process["reused_tokens"]
    assert server["reprefill_tokens"] == server["prompt_tokens"]


def assert_context_shift_is_the_sink_policy(rows: Mapping[str, Mapping[str, Any]]) -> None:
    """One prompt, then a long forced generation, shifted by the server (n_keep 4, one token at
    a time) and by the in-process engine: the same perplexity, up to float rounding."""
    server = rows["smollm2-server-generate-sink4"]["metrics"]
    in_process = rows["smollm2-generate-sink4-onecall"]["metrics"]
    assert server["scored_tokens"] == in_process["scored_tokens"]
    assert server["post_eviction_ppl"] == pytest.approx(in_process["post_eviction_ppl"], rel=1e-3)


def assert_served_sweep_keeps_each_sink_count(rows: Mapping[str, Mapping[str, Any]]) -> None:
    """Each sink count of the served sweep is one request whose every shift the server logged
    with n_keep = that count (SmolLM2 adds no BOS); the runs at 0 and 4 sinks and the full
    baseline are made once and shared with the generate checks (the same figures; 0 s for each
    check but the one that asked first, whichever order the tests ran in)."""
    sweep = rows["smollm2-server-sweep"]
    sink4 = rows["smollm2-server-generate-sink4"]["metrics"]
    window = rows["smollm2-server-generate-window"]["metrics"]
    by_sinks = {row["sinks"]: row for row in sweep["detail"]["samples"]}
    assert {0, 4} <= set(by_sinks)
    for sinks, row in by_sinks.items():
        assert row["sinks_kept"] == sinks
        assert row["kv_entries"] == row["first_eviction"] == 255  # cap: --ctx-size 256
        assert row["context_shifts"] == sink4["context_shifts"] > 0
    sink4_row, window_row = (rows[f"smollm2-server-generate-{p}"] for p in ("sink4", "window"))
    # Other served generate checks (a quantized candidate) keep the full-precision baseline, so
    # they share that run too, and may be the one that asked first.
    others = [row["seconds"]["baseline"] for name, row in rows.items()
              if name.startswith("smollm2-server-generate-") and row not in (sink4_row, window_row)
              and "baseline" in row.get("seconds", {})]  # fmt: skip
    shared_runs = {
        "baseline": [sweep["seconds"]["baseline"], sink4_row["seconds"]["baseline"],
                     window_row["seconds"]["baseline"], *others],
        "sink4": [sweep["seconds"]["sink4/255 reidx step1"], sink4_row["seconds"]["generate"]],
        "window": [sweep["seconds"]["window/255 reidx step1"], window_row["seconds"]["generate"]],
    }  # fmt: skip
    for run, seconds in shared_runs.items():
        assert sum(s > 0.0 for s in seconds) == 1, (run, seconds)
    assert by_sinks[4]["post_eviction_ppl"] == sink4["post_eviction_ppl"]
    assert by_sinks[0]["post_eviction_ppl"] == window["post_eviction_ppl"]
    assert all(row["post_eviction_ppl"] < by_sinks[0]["post_eviction_ppl"]
               for sinks, row in by_sinks.items() if sinks)  # fmt: skip


AGREEMENTS = {
    "served sink sweep": (assert_served_sweep_keeps_each_sink_count, (
        "smollm2-server-sweep", "smollm2-server-generate-sink4",
        "smollm2-server-generate-window")),
    "server checkpoints": (assert_server_checkpoints_differ, (
        "gemma3-server-ckpt-edit-middle", "gemma3-ckpt-edit-middle")),
    "server context shift": (assert_context_shift_is_the_sink_policy, (
        "smollm2-server-generate-sink4", "smollm2-generate-sink4-onecall")),
}  # fmt: skip
"""Agreements between checks of one report, each with the checks it needs."""
SERVED_AGREEMENTS = [
    "served counts: smollm2-server-full-edit-end",
    "served sink sweep",
    "server context shift",
]
"""The agreements a file with one served edit-replay, generate and sweep applies (the quick
gate's, and the test suite's engine_checks.yaml)."""


def assert_agreements(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every agreement whose checks are all in ``rows`` (served edit-replay counts pair by
    pair); the names of those that applied."""
    applied = [f"served counts: {name}" for name in assert_served_counts_equal(rows)]
    for name, (agreement, needs) in AGREEMENTS.items():
        if all(check in rows for check in needs):
            agreement(rows)
            applied.append(name)
    return applied


# README's quoted gate output.

TAG = re.compile(
    r"<!-- kvguard-output: (?P<file>\S+?)(?:; measured on: (?P<where>[^>]*?))? -->\n"
    r"```\n(?P<block>.*?)\n```",
    re.S,
)
"""A README block of gate output, tagged with the budgets file that printed it and the machine
it printed on (``measured_on``)."""
NOT_COMPARED = {"replay s", "peak"}
"""Columns README quotes but no run repeats exactly: wall-clock seconds, and peak memory, which
is process-wide (mlx's allocator peak moves with what the process ran before; see README,
Determinism)."""
EXACT = {"check", "model", "policy", "tokens", "baseline", "follow-up", "via", "prompt", "split",
         "reused", "re-prefilled", "held", "positions", "turns", "scored", "fact evicted",
         "verdict"}  # fmt: skip
"""Columns that do not depend on the machine (token counts, settings, verdicts): compared on
every machine. The rest (perplexities, NLL, bytes, attention mass, engine versions) only where
the run is on the machine and engine versions README quotes."""
NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?")


def measured_on(machine: Mapping[str, Any]) -> str:
    """How a README tag names the machine a report was made on."""
    return f"{machine['cpu']}, {machine['machine']}, Python {machine['python']}"


@dataclass(frozen=True)
class QuotedTable:
    """One table of a README block: its header and its rows, as cells by column name."""

    headers: list[str]
    rows: list[dict[str, str]]


def split_tables(block: str) -> list[QuotedTable | str]:
    """The tables of a block printed by tabulate's ``simple`` format (header, dashes, rows;
    tables separated by blank lines), cut into columns where the dashes line has its gaps.
    A chunk that is not such a table is returned as its text."""
    tables: list[QuotedTable | str] = []
    for chunk in re.split(r"\n\s*\n", block.strip("\n")):
        lines = chunk.splitlines()
        if len(lines) < 3 or not lines[1].strip() or not set(lines[1]) <= {"-", " "}:
            tables.append(chunk)
            continue
        spans = [m.span() for m in re.finditer(r"-+", lines[1])]

        def cells(line: str, spans: list[tuple[int, int]] = spans) -> list[str]:
            bounds = [start for start, _ in spans[1:]] + [None]
            return [line[s:e].strip() for (s, _), e in zip(spans, bounds, strict=True)]

        headers = cells(lines[0])
        tables.append(QuotedTable(headers, [dict(zip(headers, cells(ln), strict=True))
                                            for ln in lines[2:]]))  # fmt: skip
    return tables


def quoted_blocks(readme: str, budgets_file: str) -> list[tuple[str, str | None]]:
    """README's blocks of output printed by a run of ``budgets_file`` (a path as written),
    each with the machine its tag names (None where it names none)."""
    return [(m.group("block"), m.group("where")) for m in TAG.finditer(readme)
            if m.group("file") == budgets_file]  # fmt: skip


def same_cell(quoted: str, rendered: str) -> bool:
    """Equal text, or the same text around the same numbers, where a number printed with
    decimals may differ by one unit of its last digit (a figure that rounds the other way
    between runs). Whole numbers (token counts, cells) must be equal."""
    if quoted == rendered:
        return True
    a, b = NUMBER.findall(quoted), NUMBER.findall(rendered)
    if NUMBER.sub("#", quoted) != NUMBER.sub("#", rendered) or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        decimals = len(x.partition(".")[2])
        if decimals != len(y.partition(".")[2]):
            return False
        unit = 10.0**-decimals if decimals else 0.0
        if abs(float(x.replace(",", "")) - float(y.replace(",", ""))) > unit * 1.0001:
            return False
    return True


def readme_drift(
    readme: str,
    budgets_file: str,
    report_rows: Iterable[Mapping[str, Any]],
    machine: Mapping[str, Any],
) -> tuple[int, list[str], bool]:
    """Compare every README table quoted from ``budgets_file`` with the same checks' rows
    rendered from a report made on ``machine``: every cell where the report comes from the
    machine and engine versions README quotes, the ``EXACT`` columns elsewhere. Returns the
    number of cells compared, each difference, and whether every cell could be compared."""
    by_name = {row["name"]: row for row in report_rows}
    compared, drift, everything = 0, [], True
    blocks = quoted_blocks(readme, budgets_file)
    if not blocks:
        return (
            0,
            [
                f"README quotes no output of {budgets_file} "
                f"(<!-- kvguard-output: {budgets_file}; measured on: ... -->)"
            ],  # fmt: skip
            True,
        )
    for block, where in blocks:
        here = where == measured_on(machine)
        for table in split_tables(block):
            if isinstance(table, str):
                drift.append(f"README block of {budgets_file} has a part that is not a table: "
                             f"{table.splitlines()[0][:60]!r}")  # fmt: skip
                continue
            names = [r["check"] for r in table.rows if r.get("check")]
            missing = [n for n in names if n not in by_name]
            if missing:
                drift.append(f"README quotes checks the report lacks: {', '.join(missing)}")
                continue
            errors = [n for n in names if by_name[n]["verdict"] == "ERROR"]
            if errors:
                drift.append(
                    f"README quotes checks that errored in the report: {', '.join(errors)}"
                )
                continue
            rendered_block = render_table([row_from_json(by_name[n]) for n in names])
            rendered = next((t for t in split_tables(rendered_block) if isinstance(t, QuotedTable)
                             and t.headers[:4] == table.headers[:4]), None)  # fmt: skip
            if rendered is None or len(rendered.rows) != len(table.rows):
                drift.append(f"README table of {', '.join(names)}: its shape differs from the "
                             "table the report renders")  # fmt: skip
                continue
            same_engines = all(q.get("engine", "") == r.get("engine", "")
                               for q, r in zip(table.rows, rendered.rows, strict=True))  # fmt: skip
            every_cell = here and same_engines
            everything = everything and every_cell
            check = ""
            for quoted_row, rendered_row in zip(table.rows, rendered.rows, strict=True):
                check = quoted_row.get("check") or check
                for column, cell in quoted_row.items():
                    if column in NOT_COMPARED or not (every_cell or column in EXACT):
                        continue
                    if column not in rendered_row:
                        drift.append(f"{check}: README has a column '{column}' the table lacks")
                        continue
                    compared += 1
                    if not same_cell(cell, rendered_row[column]):
                        drift.append(f"{check} {column}: README {cell!r}, measured "
                                     f"{rendered_row[column]!r}")  # fmt: skip
    return compared, drift, everything


def quotable_output(rows: Iterable[Mapping[str, Any]], drop: tuple[str, ...] = ("budget",)) -> str:
    """The tables a gate run prints for these report rows, without the ``drop`` columns: what
    README quotes under a ``<!-- kvguard-output: FILE -->`` tag."""
    from tabulate import tabulate

    rendered = render_table([row_from_json(row) for row in rows])
    parts = []
    for table in split_tables(rendered):
        assert isinstance(table, QuotedTable), table
        headers = [h for h in table.headers if h not in drop]
        lines = [[row[h] for h in headers] for row in table.rows]
        parts.append(tabulate(lines, headers=headers, disable_numparse=True))
    return "\n\n".join(parts)


if __name__ == "__main__":
    # python tests/gate_invariants.py REPORT [CHECK ...]: the tables to quote in README.
    import json
    import sys

    report = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    wanted = sys.argv[2:]
    print(f"measured on: {measured_on(report['machine'])}")
    print(quotable_output([r for r in report["checks"] if not wanted or r["name"] in wanted]))
