"""The documentation's promises: README's two set-up commands (and .ci/run runs the second),
the reference's tables equal to what the code generates, every relative link resolving, and a
README short enough to be a front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_workflows import ACTION, _load

from pytest_kvguard.cli import docs
from pytest_kvguard.core.budgets import Budgets
from pytest_kvguard.engines import ENGINES
from pytest_kvguard.gate.baseline import comparable_metrics
from pytest_kvguard.gate.budgets_file import TOP_KEYS
from pytest_kvguard.gate.checks import CHECK_KEYS
from pytest_kvguard.plugin.options import ENVIRONMENT
from pytest_kvguard.scenarios import SCENARIOS

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
REFERENCE = ROOT / docs.REFERENCE
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""Every page of the documentation: README and docs/**/*.md."""


def setup_commands() -> tuple[str, str]:
    """README's two set-up commands: the quick gate, then the test suite."""
    commands = re.findall(r"```sh\n(.+?)\n```", README, flags=re.S)
    assert len(commands) == 2
    return commands[0], commands[1]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    gate, tests = setup_commands()
    assert "--kvguard fixtures/quick.yaml" in gate and gate.startswith("bash .ci/install ")
    # As printed, or as printed with `|| exit 1` (set -e spares a failure inside an && list).
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines or f"{tests} || exit 1" in ci_lines


def test_readme_is_a_front_door() -> None:
    lines = README.count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move sections into docs/ (at most 250)"


def test_readme_links_every_scenario_to_its_page() -> None:
    missing = [n for n in SCENARIOS if f"](docs/scenarios/{n}.md)" not in README]
    assert not missing, f"README has no line linking docs/scenarios/NAME.md for: {missing}"
    assert not [n for n in SCENARIOS if not (ROOT / "docs" / "scenarios" / f"{n}.md").exists()]


@pytest.mark.parametrize("section", list(docs.SECTIONS))
def test_the_reference_carries_the_generated_table(section: str) -> None:
    """Each table of docs/reference.md is, verbatim, what the code generates today."""
    found = {m["name"]: m["body"] for m in docs.SECTION.finditer(REFERENCE.read_text())}
    assert section in found, (
        f"{docs.REFERENCE} has no '<!-- generated: {section} -->' ... '<!-- end generated -->' "
        f"section: add the markers, then run {docs.FIX}"
    )
    assert found[section] == docs.SECTIONS[section](), (
        f"{docs.REFERENCE}'s '{section}' table differs from the code's: run {docs.FIX}"
    )


def test_regenerating_a_stale_reference_makes_it_current(tmp_path: Path) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text("intro\n<!-- generated: budgets -->\nold\n<!-- end generated -->\nend\n")
    assert docs.docs_main(["--check", str(stale)]) == 1
    assert docs.docs_main(["--write", str(stale)]) == 1  # it says the other sections are missing
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith("<!-- end generated -->\nend\n")
    assert docs.stale_sections(text) == [s for s in docs.SECTIONS if s != "budgets"]


def test_the_budgets_table_lists_every_budget_with_its_scenarios() -> None:
    table = docs.budgets_markdown()
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines()[2:]}
    assert list(rows) == list(Budgets.names())
    for name, scenario in SCENARIOS.items():
        for budget in scenario.budgets:
            assert f"`{name}`" in rows[budget].split("|")[2], (budget, name)


def test_the_support_table_is_what_the_engines_implement() -> None:
    """The probe's answers agree with the engine registry: no engine runs a policy its adapter
    does not implement for some engine path, and every scenario runs somewhere."""
    grid = docs.support()
    for name, row in grid.items():
        assert any(kinds is not None for kinds in row.values()), f"{name} runs on no engine"
        for engine, kinds in row.items():
            implemented = {k for ks in ENGINES[engine].policies.values() for k in ks}
            assert set(kinds or ()) <= implemented, (name, engine)
    assert grid["edit_replay"]["openai"] == ["full", "swa"]
    assert grid["stream"]["llama_server"] is None  # the HTTP API gives no logits per token


ENVIRONMENT_READ = re.compile(
    r"""environ(?:\.get\(|\[|\.setdefault\()\s*["']([A-Z][A-Z0-9_]*)["']"""
    r"""|["'](KVGUARD_[A-Z0-9_]*)["']"""
)


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    """Each name read from the environment (or a KVGUARD_ name the code holds) is in
    options.ENVIRONMENT; a bundled model's KVGUARD_MODEL_ prefix counts as documented."""
    read = set()
    for path in (ROOT / "pytest_kvguard").rglob("*.py"):
        for match in ENVIRONMENT_READ.finditer(path.read_text(encoding="utf-8")):
            read.add(match[1] or match[2])
    documented = set(docs.environment_names())
    prefixes = {name for name in read if name.endswith("_")}
    assert prefixes == {"KVGUARD_MODEL_"}
    undocumented = read - documented - prefixes
    assert not undocumented, f"add these to options.ENVIRONMENT: {sorted(undocumented)}"
    assert not set(ENVIRONMENT) - read, "options.ENVIRONMENT names a variable nothing reads"


def test_every_name_outside_the_generated_tables_is_documented() -> None:
    """Names with no generated table (every check's own keys, the file's top-level keys, the
    figures a baseline compares, the action's inputs) appear on some page."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    names = [*CHECK_KEYS, *TOP_KEYS, *comparable_metrics(), *_load(ACTION)["inputs"]]
    missing = [name for name in names if f"`{name}" not in text]
    assert not missing


# Relative links.

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (lower case, punctuation dropped, spaces
    to hyphens; a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_anchors_are_githubs() -> None:
    page = ROOT / "docs" / "environments.md"
    assert "a-real-regression-caught-mlx-lm-0280---0281" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    """Every relative link reaches an existing file and, where it names one, a heading there."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
