"""The reference tables, generated from the code: docs/reference.md carries each between
``<!-- generated: NAME -->`` and ``<!-- end generated -->`` markers, and a test keeps them equal.

``kvguard docs`` prints them, ``kvguard docs --check`` says which copies in the file are stale,
``kvguard docs --write`` regenerates them in place. ``kvguard scenarios`` prints the scenarios'
own tables (what the installed version takes) and, with ``--schema``, the JSON report's schema.

Every table reads its source of truth: the budgets the scenarios declare (``Limit``), the scenario
registry, the engine registry, the options as ``options.add_options`` declares them, and
``options.ENVIRONMENT`` (whose names a test matches with what the package reads).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.budgets import known_limits
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.core.policies import POLICY_KINDS, POSITION_MODES
from pytest_kvguard.engines import ENGINES
from pytest_kvguard.engines.protocols import CAPABILITIES, PREFIX_CACHE_CAPABILITIES
from pytest_kvguard.gate.report import report_schema
from pytest_kvguard.inputs.models import BUNDLED_MODELS, env_var_for
from pytest_kvguard.plugin.options import ENVIRONMENT, MODEL_ENVIRONMENT, add_options
from pytest_kvguard.scenarios import SCENARIOS
from pytest_kvguard.scenarios.base import PARAM_KINDS, Fields, Scenario

REFERENCE = Path("docs/reference.md")
"""Where the generated tables live, relative to the repository root."""
FIX = "kvguard docs --write (or: python -m pytest_kvguard.cli.docs --write)"
"""The command that regenerates them, as failure messages name it."""
SECTION = re.compile(
    r"<!-- generated: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- end generated -->", re.S
)


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def scenarios_markdown() -> str:
    """A section per scenario: what it does, its check keys, its parameters, its budgets."""
    parts = []
    for name, scenario in SCENARIOS.items():
        keys = "`engines` (two)" if scenario.engines == 2 else "`engine`"
        if scenario.takes_policy:
            keys += ", `policy`"
        if scenario.takes_baseline:
            keys += ", `baseline` (default `full`)"
        lines = [
            f"### `{name}`",
            "",
            f"{scenario.summary[0].upper()}{scenario.summary[1:]}. Check keys: {keys}.",
            "",
            "| param | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for p in scenario.params:
            default = "—" if p.default is None else f"`{p.default!r}`".replace("'", "")
            kind = PARAM_KINDS[p.kind] + (f" >= {p.minimum}" if p.minimum is not None else "")
            lines.append(f"| `{p.name}` | {kind} | {default} | {p.doc} |")
        lines += ["", "Budgets: " + ", ".join(f"`{b}`" for b in scenario.budgets) + "."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


BOUNDS = {"max": "at most", "min": "at least", "flag": "flag: `true` gates it"}
"""How each kind of budget bound reads in the table."""


def budgets_markdown() -> str:
    """Every budget: the scenarios it applies to, its bound, its unit and what it limits."""
    lines = [
        "| budget | scenarios | bound | unit | limits |",
        "|---|---|---|---|---|",
    ]
    for limit in known_limits().values():
        scenarios = ", ".join(f"`{n}`" for n, s in SCENARIOS.items() if limit.name in s.budgets)
        unit = limit.unit.strip() or "—"
        if limit.bound != "flag" and limit.unit.strip() in ("B", "B/token"):
            unit += ' (or a size: `"6 MiB"`)'
        lines.append(
            f"| `{limit.name}` | {scenarios} | {BOUNDS[limit.bound]} | {_cell(unit)} | "
            f"{_cell(limit.doc)} (figure `{limit.metric}`) |"
        )
    return "\n".join(lines) + "\n"


PROBE_PARAMS = {"cap": 255, "followup": "append"}
"""Values the support probe gives parameters that have no default: a cap every engine accepts
(llama-server's context is a multiple of 256 cells, and it shifts one token early) and a
follow-up every engine can replay."""
UNSUPPORTED = ("does not implement", "never evicts")
"""What a refusal of an engine or policy says (any other refusal is a probe that lacks a
parameter: the generator stops and names it)."""


def _builds(scenario: Scenario[Any], engines: tuple[str, ...], kind: str | None) -> bool:
    """Whether a check of ``scenario`` on ``engines`` with policy ``kind`` parses: the same
    refusals a budgets file meets (``Scenario.build``), with the probe's parameters."""
    params = {p.name: p.default for p in scenario.params}
    params.update({k: v for k, v in PROBE_PARAMS.items() if params.get(k, 0) is None})
    fields_ = Fields(engines=engines, policy=kind, baseline=None, params=params, base_dir=Path(),
                     scenario=scenario.name, engine_path=scenario.engine_path)  # fmt: skip
    try:
        scenario.build(fields_)
    except KvguardError as exc:
        if exc.key in ("policy", "engine", "engines") or any(w in str(exc) for w in UNSUPPORTED):
            return False
        raise RuntimeError(
            f"the support probe could not build {scenario.name} on {', '.join(engines)} with "
            f"policy {kind}: {exc} (give docs.PROBE_PARAMS a value for it)"
        ) from exc
    return True


def support() -> dict[str, dict[str, list[str] | None]]:
    """For each scenario and engine: the policy kinds a check may name there ([] for a
    scenario that takes none), None where the engine cannot run the scenario."""
    table: dict[str, dict[str, list[str] | None]] = {}
    for name, scenario in SCENARIOS.items():
        table[name] = {}
        for engine in ENGINES:
            pairs: list[tuple[str, ...]] = [(engine,)]
            if scenario.engines == 2:  # the other engine: any the scenario runs on
                pairs = [(engine, other) for other in ENGINES if other != engine]
            kinds = list(POLICY_KINDS) if scenario.takes_policy else [None]
            ok = [k for k in kinds if any(_builds(scenario, p, k) for p in pairs)]
            table[name][engine] = [k for k in ok if k] if ok else None
    return table


def support_markdown() -> str:
    """Scenarios x engines: the policies a check may name on each (— : not on that engine)."""
    grid = support()
    lines = [
        "| scenario | " + " | ".join(f"`{e}`" for e in ENGINES) + " |",
        "|---|" + "---|" * len(ENGINES),
    ]
    for name, row in grid.items():
        cells = []
        for engine in ENGINES:
            kinds = row[engine]
            if kinds is None:
                cells.append("—")
            else:
                cells.append(", ".join(f"`{k}`" for k in kinds) if kinds else "yes (no policy)")
        lines.append(f"| [`{name}`](scenarios/{name}.md) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_keys_markdown() -> str:
    """What each scenario's checks name: engine(s), policy, baseline; and its budgets."""
    lines = [
        "| scenario | engines | `policy` | `baseline` | budgets |",
        "|---|---|---|---|---|",
    ]
    for name, scenario in SCENARIOS.items():
        engines = "`engines`: two, reference first" if scenario.engines == 2 else "`engine`"
        policy = (
            "required"
            if scenario.takes_policy
            else "refused: " + _cell(scenario.no_policy[0] or "the scenario sets its own")
        )
        baseline = "default `full`" if scenario.takes_baseline else "refused"
        budgets = ", ".join(f"`{b}`" for b in scenario.budgets)
        lines.append(f"| `{name}` | {engines} | {policy} | {baseline} | {budgets} |")
    return "\n".join(lines) + "\n"


def engines_markdown() -> str:
    """Every engine adapter: how to install it, what a model may be, its position handling,
    and the policy kinds it implements per engine path."""
    lines = [
        "| engine | policies per engine path | positions (own first) | model | capabilities "
        "| install |",
        "|---|---|---|---|---|---|",
    ]
    for name, info in ENGINES.items():
        paths = "; ".join(
            f"{path}: " + ", ".join(f"`{k}`" for k in kinds)
            for path, kinds in info.policies.items()
        )
        positions = ", ".join(f"`{p}`" for p in info.position_modes)
        models = ", ".join(info.model_forms)
        capabilities = ", ".join(f"`{c}`" for c in sorted(info.capabilities)) or "—"
        lines.append(
            f"| `{name}` | {paths} | {positions} | {models} | {capabilities} | "
            f"{_cell(info.install)} |"
        )
    return "\n".join(lines) + "\n"


def capabilities_markdown() -> str:
    """Every optional capability an adapter (or its prefix cache) may have, from its protocol's
    docstring, and the engines that declare it."""
    lines = ["| capability | what it gives | engines |", "|---|---|---|"]
    for name, protocol in {**CAPABILITIES, **PREFIX_CACHE_CAPABILITIES}.items():
        doc = " ".join((protocol.__doc__ or "").split()).replace("``", "`")
        doc = doc.split(": ", 1)[1] if doc.startswith(("Capability", "Prefix-cache")) else doc
        engines = ", ".join(f"`{e}`" for e, i in ENGINES.items() if name in i.capabilities)
        lines.append(f"| `{name}` | {_cell(doc)} | {engines or '—'} |")
    return "\n".join(lines) + "\n"


def policies_markdown() -> str:
    """Every policy kind and position handling a check may name."""
    lines = ["| policy | what stays in the cache |", "|---|---|"]
    lines += [f"| `{k}` | {_cell(doc)} |" for k, doc in POLICY_KINDS.items()]
    lines += ["", "| positions | after an eviction |", "|---|---|"]
    lines += [f"| `{k}` | {_cell(doc)} |" for k, doc in POSITION_MODES.items()]
    return "\n".join(lines) + "\n"


class _Recorder:
    """Stands in for pytest's parser: records what ``add_options`` declares."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.inis: dict[str, tuple[str, str | None]] = {}

    def getgroup(self, name: str, description: str = "") -> _Recorder:
        return self

    def addoption(self, *names: str, **kwargs: Any) -> None:
        self.options.append((names, kwargs))

    def addini(self, name: str, help: str, type: str | None = None, default: Any = None) -> None:
        self.inis[name] = (help, type)


INI_TYPES = {"linelist": " (one per line)", "bool": " (true/false)"}


def options_markdown() -> str:
    """Every command-line option, its ini key and its help, as ``add_options`` declares them."""
    recorder = _Recorder()
    add_options(cast(Any, recorder))
    lines = ["| option | ini key | meaning |", "|---|---|---|"]
    for names, kwargs in recorder.options:
        help_text = kwargs["help"]
        ini = re.search(r"\(ini: (\w+)[^)]*\)\.?$", help_text)
        assert ini, f"{names[0]}'s help names no ini key"
        help_text = help_text[: ini.start()].rstrip()
        help_text += "" if help_text.endswith(".") else "."
        ini_name = ini.group(1)
        metavar = kwargs.get("metavar")
        option = " ".join([*names, metavar] if metavar else names)
        ini_type = INI_TYPES.get(recorder.inis[ini_name][1] or "", "")
        lines.append(f"| `{option}` | `{ini_name}`{ini_type} | {_cell(help_text)} |")
    return "\n".join(lines) + "\n"


def environment_names() -> dict[str, str]:
    """Every environment variable kvguard reads, with what it does (a bundled model's
    override once per bundled model)."""
    names = dict(ENVIRONMENT)
    for model in BUNDLED_MODELS:
        names[env_var_for(model)] = MODEL_ENVIRONMENT.format(model=model)
    return names


def environment_markdown() -> str:
    lines = ["| variable | meaning |", "|---|---|"]
    lines += [f"| `{n}` | {_cell(doc)} |" for n, doc in environment_names().items()]
    return "\n".join(lines) + "\n"


SECTIONS: dict[str, Callable[[], str]] = {
    "budgets": budgets_markdown,
    "check-keys": check_keys_markdown,
    "support": support_markdown,
    "engines": engines_markdown,
    "capabilities": capabilities_markdown,
    "policies": policies_markdown,
    "options": options_markdown,
    "environment": environment_markdown,
    "scenarios": scenarios_markdown,
}
"""Each generated table (by its marker name) and the function that renders it."""


def stale_sections(text: str) -> list[str]:
    """The sections whose copy in ``text`` differs from the code's (or is missing)."""
    found = {m.group("name"): m.group("body") for m in SECTION.finditer(text)}
    return [name for name, render in SECTIONS.items() if found.get(name) != render()]


def regenerate(text: str) -> str:
    """``text`` with every generated section's body replaced by the code's."""
    return SECTION.sub(
        lambda m: (
            f"<!-- generated: {m.group('name')} -->\n{SECTIONS[m.group('name')]()}"
            "<!-- end generated -->"
        ),
        text,
    )


def docs_main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-docs") -> int:
    """``kvguard docs``: print every generated table; ``--check [FILE]``: exit 1 when a copy in
    FILE (default docs/reference.md) is stale; ``--write [FILE]``: regenerate them there."""
    parser = OneLineParser(
        prog=prog, description=f"The reference tables of {REFERENCE}, generated from the code."
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", nargs="?", const=REFERENCE, type=Path, metavar="FILE",
                        help=f"exit 1 naming the sections whose copy in FILE (default "
                        f"{REFERENCE}) is stale")  # fmt: skip
    action.add_argument("--write", nargs="?", const=REFERENCE, type=Path, metavar="FILE",
                        help="regenerate them in FILE (default: the same)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.check is None and args.write is None:
        for name, render in SECTIONS.items():
            sys.stdout.write(f"<!-- generated: {name} -->\n{render()}<!-- end generated -->\n\n")
        return 0
    path: Path = args.write if args.check is None else args.check
    try:
        text = path.read_text(encoding="utf-8")
        if args.write is not None:
            missing = [n for n in SECTIONS if f"<!-- generated: {n} -->" not in text]
            path.write_text(regenerate(text), encoding="utf-8")
            if missing:
                sys.stderr.write(f"{path} has no marker for: {', '.join(missing)}\n")
                return 1
            return 0
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        fix = "run it from the repository root" if path == REFERENCE else "give a Markdown file"
        sys.stderr.write(f"{prog}: {path}: {reason} (fix: {fix})\n")
        return 2
    stale = stale_sections(text)
    if stale:
        sys.stderr.write(f"{path}: stale generated sections: {', '.join(stale)} (fix: {FIX})\n")
        return 1
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-scenarios") -> int:
    """``kvguard scenarios``: the tables as Markdown; ``--schema``: the JSON report's schema."""
    parser = OneLineParser(
        prog=prog,
        description="Each scenario's check keys, parameters and budgets, as Markdown, for the "
        "installed version.",
    )
    parser.add_argument("--schema", action="store_true", help="print the JSON report's schema")
    if parser.parse_args(argv).schema:
        sys.stdout.write(json.dumps(report_schema(), indent=2) + "\n")
    else:
        sys.stdout.write(scenarios_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(docs_main())
