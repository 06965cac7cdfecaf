"""``kvguard SUBCOMMAND [ARGS...]``: every command of the package behind one name.

Each subcommand is an existing command's ``main``, imported only when it is chosen (``kvguard
--help`` imports no engine), and told its prog (``kvguard compare``) so its own ``--help`` and
errors name it as typed. The old ``kvguard-SUBCOMMAND`` scripts call the same functions, kept as
aliases for one release.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple, Protocol

PROG = "kvguard"


class Subcommand(NamedTuple):
    module: str
    function: str
    summary: str


class SubcommandMain(Protocol):
    def __call__(self, argv: Sequence[str] | None = None, *, prog: str = ...) -> int: ...


SUBCOMMANDS: dict[str, Subcommand] = {
    "capacity": Subcommand(
        "pytest_kvguard.cli.capacity", "main",
        "KV-cache bytes per policy and context length, from a GGUF or config.json",
    ),
    "compare": Subcommand(
        "pytest_kvguard.cli.compare", "main",
        "two JSON reports, figure by figure: did a change of kvguard move anything?",
    ),
    "scenarios": Subcommand(
        "pytest_kvguard.cli.docs", "main",
        "the scenarios' tables as Markdown; --schema: the JSON report's schema",
    ),
    "docs": Subcommand(
        "pytest_kvguard.cli.docs", "docs_main",
        "print, --check or --write the generated tables of docs/reference.md",
    ),
    "model-facts": Subcommand(
        "pytest_kvguard.cli.model_facts", "main",
        "a model's cache-relevant facts without weights, and what a candidate changes",
    ),
    "quantize": Subcommand(
        "pytest_kvguard.cli.quantize", "main",
        "re-quantize a GGUF model with llama.cpp: a candidate for the model preview",
    ),
    "env": Subcommand(
        "pytest_kvguard.isolation.environments", "main",
        "make (once, cached) an environment with an engine version; print its python",
    ),
    "bisect": Subcommand(
        "pytest_kvguard.cli.bisect", "main",
        "find the first engine release that fails the picked checks of a budgets file",
    ),
    "saved-cache": Subcommand(
        "pytest_kvguard.cli.saved_cache", "main",
        "can one engine release read the prompt caches another one saved?",
    ),
    "build-llama-server": Subcommand(
        "pytest_kvguard.cli.llama_server_build", "main",
        "build llama-server from llama-cpp-python's own llama.cpp; cache, install it",
    ),
}  # fmt: skip
"""Every subcommand: the module and function that run it (the old ``kvguard-NAME`` script's
entry point), and its one line for ``kvguard --help``."""


def usage() -> str:
    width = max(map(len, SUBCOMMANDS)) + 2
    lines = [
        f"usage: {PROG} SUBCOMMAND [ARGS...]",
        "",
        "pytest-kvguard's commands (kvguard SUBCOMMAND --help shows each one's options):",
        "",
        *(f"  {name:<{width}}{sub.summary}" for name, sub in SUBCOMMANDS.items()),
        "",
        "options:",
        "  -h, --help  show this help and exit",
        "  --version   print pytest-kvguard's version and exit",
        "",
        "The old kvguard-SUBCOMMAND scripts (kvguard-compare, ...) run the same commands; they are",
        "kept as aliases for one release.",
    ]
    return "\n".join(lines) + "\n"


def unknown(name: str) -> str:
    """The one line for a subcommand that does not exist."""
    close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"{PROG}: unknown subcommand '{name}'{hint}; the subcommands are: "
        f"{', '.join(SUBCOMMANDS)} (see {PROG} --help)"
    )


def load(name: str) -> SubcommandMain:
    """The chosen subcommand's main function, its module imported now."""
    sub = SUBCOMMANDS[name]
    function: SubcommandMain = getattr(importlib.import_module(sub.module), sub.function)
    return function


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write(usage())
        return 2
    first, rest = args[0], args[1:]
    if first in ("-h", "--help") or (first == "help" and not rest):
        sys.stdout.write(usage())
        return 0
    if first == "help" and rest:  # kvguard help SUBCOMMAND: that subcommand's --help
        first, rest = rest[0], ["--help"]
    if first == "--version":
        from importlib.metadata import version

        print(f"{PROG} {version('pytest-kvguard')}")
        return 0
    if first not in SUBCOMMANDS:
        print(unknown(first), file=sys.stderr)
        return 2
    try:
        return load(first)(rest, prog=f"{PROG} {first}")
    except SystemExit as exc:  # argparse's --help and usage errors
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
