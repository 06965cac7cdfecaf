"""``kvguard saved-cache``: can one engine release read the caches another one saved?

    kvguard saved-cache --writer PY --reader PY [--reader PY ...] [--engine mlx|llama_cpp]
                        [--kind KIND ...] [--model smollm2-135m|gemma3-270m|FILE.gguf]

PY is the python of an engine environment (``kvguard env "mlx-lm==0.31.3"`` or
``kvguard env "llama-cpp-python==0.3.35"`` prints one). For each kind, the writer saves the
bundled chat's cache with its own calls (mlx-lm: ``save_prompt_cache``; llama-cpp-python: the
pickled ``Llama.save_state()`` an app or ``LlamaDiskCache`` stores); each reader loads it with
its own (``load_prompt_cache``; unpickling and ``Llama.load_state``) and, where that works,
scores a forced reply on the loaded cache against a fresh prefill of its own
(``engines/mlx/saved_cache.py``, ``engines/llama_cpp/saved_state.py``, run in those
interpreters). A row PASSes when the file loads and the scores agree within the tolerance
(mlx-lm, exact on the CPU: mean and largest |dNLL|; llama.cpp: the reuse excess over its own
floor, as edit_replay judges a reuse); it FAILs, quoting the engine's error in one line, when
the file does not load or cannot be used, and when the scores are further apart.
Exit status 1 on any FAIL or ERROR, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pytest_kvguard.core.args import OneLineParser, whole_number
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines.llama_cpp import saved_state
from pytest_kvguard.engines.mlx import saved_cache
from pytest_kvguard.engines.mlx.saved_cache import (
    DEFAULT_CAP,
    DEFAULT_MESSAGES,
    DEFAULT_REPLY_TOKENS,
    DEFAULT_SINKS,
)

PROG = "kvguard-saved-cache"


@dataclass(frozen=True)
class SavedEngine:
    """What the command does for one engine: who writes and reads, and the kinds it saves."""

    package: str
    """The distribution whose release is tested (its version names the rows)."""
    entry: str
    """The module the writer and readers run."""
    kinds: Mapping[str, str]
    default_kinds: tuple[str, ...]
    suffix: str
    reply_tokens: int
    """Forced reply tokens scored by default."""


SAVED_ENGINES = {
    "mlx": SavedEngine("mlx-lm", "pytest_kvguard.engines.mlx.saved_cache", saved_cache.KINDS,
                       ("plain", "rotating"), ".safetensors", DEFAULT_REPLY_TOKENS),
    "llama_cpp": SavedEngine("llama-cpp-python", "pytest_kvguard.engines.llama_cpp.saved_state",
                             saved_state.KINDS, ("full",), ".pickle",
                             saved_state.DEFAULT_REPLY_TOKENS),
}  # fmt: skip
MAX_REUSE_EXCESS = 0.1
"""nats per reply token, llama.cpp: the reuse gap of the loaded state over llama.cpp's own floor
on these ids, the tolerance edit_replay's bundled checks judge a reuse with (docs/scenarios/
edit_replay.md has the measurements behind it)."""
MAX_MEAN_ABS_NLL_DIFF = 1e-3
"""nats. A file read back by the release that wrote it scores exactly like a fresh prefill
(0.0, measured on every release here); the same release prefilling on mlx's bundled reference
BLAS instead of OpenBLAS moves the mean by about 1e-6 (see docs/saved-caches.md). A misread
position or a lost entry moves it by tenths of a nat and more."""
MAX_ABS_NLL_DIFF = 1e-2
"""nats, for the single worst reply token; the BLAS change above moves it by about 1e-5."""
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Tolerance:
    """How far a loaded cache's reply scores may be from a fresh prefill's."""

    mean_abs_nll_diff: float = MAX_MEAN_ABS_NLL_DIFF
    """Mean |NLL difference| over the reply tokens, nats."""
    max_abs_nll_diff: float = MAX_ABS_NLL_DIFF
    """Largest |NLL difference| of one reply token, nats."""
    reuse_excess: float = MAX_REUSE_EXCESS
    """llama.cpp: mean |NLL difference| beyond its own floor, nats."""


def judge(read: Mapping[str, Any], tolerance: Tolerance) -> tuple[str, str]:
    """A reader's result as a verdict (PASS, FAIL or ERROR) and its reason, in one line."""
    if "loads" not in read:
        return "ERROR", f"reader failed: {read.get('error', 'no result')}"
    if not read["loads"]:
        return "FAIL", f"does not load: {read['error']}"
    if "replay_error" in read:
        return "FAIL", f"loads, then fails on use: {read['replay_error']}"
    if "metadata_error" in read:
        return "FAIL", f"loads, misread: {read['metadata_error']}"
    if "ids_error" in read:
        return "FAIL", f"loads, but {read['ids_error']}"
    if read.get("kept", math.inf) < read.get("reusable", 0):
        return "FAIL", (
            f"loads, but the follow-up reused {read['kept']} of its {read['reusable']} tokens "
            "the saved state holds"
        )
    mean, worst = read.get("mean_abs_nll_diff", math.nan), read.get("max_abs_nll_diff", math.nan)
    if "reuse_excess" in read:  # llama.cpp: judged against its own floor
        excess, floor = read["reuse_excess"], read["reuse_floor"]
        if not excess <= tolerance.reuse_excess:
            return "FAIL", (
                f"loads, but the reply scores {mean:.3g} nats apart on average from a fresh "
                f"prefill, {excess:.3g} beyond llama.cpp's own floor ({floor:.3g}); tolerance "
                f"{tolerance.reuse_excess:g}"
            )
        return "PASS", ""
    if not (mean <= tolerance.mean_abs_nll_diff and worst <= tolerance.max_abs_nll_diff):
        return "FAIL", (
            f"loads, but the reply scores {mean:.3g} nats apart on average (max {worst:.3g}) "
            f"from a fresh prefill; tolerance {tolerance.mean_abs_nll_diff:g} "
            f"(max {tolerance.max_abs_nll_diff:g})"
        )
    return "PASS", ""


def run_entry(python: str, entry: str, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """One writer or reader command in another interpreter: its JSON, or ``{"error": line}``."""
    env = dict(os.environ)
    from pytest_kvguard.isolation.workers import package_path

    # Only this pytest_kvguard goes on its path, never this environment's site-packages.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_path(), env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [python, "-m", entry, *args], capture_output=True, text=True, timeout=timeout,
            env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"{python} took over {timeout:g} s; killed"}
    except OSError as exc:
        return {"error": f"cannot run {python}: {exc.strerror}"}
    lines = done.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
        return result
    except (IndexError, json.JSONDecodeError):
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        why = tail[0].strip() if tail else f"exit status {done.returncode}, no output"
        return {"error": f"{Path(python).name} exited with status {done.returncode}: {why}"}


def release(python: str, package: str, written_as: str) -> str:
    """The release of ``package`` an interpreter has, or a one-line error."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KvguardError(f"{written_as} {python}: cannot run it ({exc})") from None
    if done.returncode != 0:
        raise KvguardError(
            f"{written_as} {python} has no {package}",
            fix=f'pass an engine environment\'s python (kvguard env "{package}==X" prints one)',
        )
    return done.stdout.strip()


def check_matrix(
    engine: SavedEngine, writer: str, readers: Sequence[str], kinds: Sequence[str], model: Path,
    common: Sequence[str], reply_tokens: int, tolerance: Tolerance, timeout: float,
    prog: str = PROG,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every kind written once by the writer and read by every reader: one row per read
    (progress on stderr, each line starting with ``prog``)."""
    versions = {py: release(py, engine.package, "--writer" if py == writer else "--reader")
                for py in (writer, *readers)}  # fmt: skip
    name = engine.package
    rows = []

    def say(message: str) -> None:
        progress(message, prog)

    with tempfile.TemporaryDirectory(prefix="kvguard-saved-cache-") as folder:
        for kind in kinds:
            file = Path(folder) / f"{kind}{engine.suffix}"
            base = ["--model", str(model), "--kind", kind, *common]
            say(f"{name} {versions[writer]} saves a {kind} cache of {model.name}")
            written = run_entry(writer, engine.entry, ["write", *base, "--out", str(file)],
                                timeout)  # fmt: skip
            if "error" in written:
                say(f"{kind}: the writer failed: {written['error']}")
            for reader in readers:
                row = {"writer": versions[writer], "reader": versions[reader], "kind": kind,
                       "model": model.name, "write": written}  # fmt: skip
                if "error" in written:
                    row.update(verdict="ERROR", reason=f"writer failed: {written['error']}")
                    rows.append(row)
                    continue
                say(f"{name} {versions[reader]} reads it and replays the chat's next turn")
                reading = ["read", *base, "--file", str(file), "--reply-tokens", str(reply_tokens)]
                read = run_entry(reader, engine.entry, reading, timeout)
                verdict, reason = judge(read, tolerance)
                row.update(read=read, verdict=verdict, reason=reason)
                say(f"{kind}: {versions[writer]} -> {versions[reader]}: {verdict} {reason}")
                rows.append(row)
    return rows


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    def figure(read: Mapping[str, Any], key: str, form: str) -> str:
        value = read.get(key)
        return "-" if value is None or math.isnan(value) else format(value, form)

    lines = []
    for r in rows:
        read = r.get("read") or {}
        loads = ("yes" if read["loads"] else "no") if "loads" in read else "-"
        verdict = f"{r['verdict']}: {r['reason']}" if r["reason"] else r["verdict"]
        lines.append([r["writer"], r["reader"], r["kind"], r["model"], loads,
                      figure(read, "mean_abs_nll_diff", ".3g"),
                      figure(read, "max_abs_nll_diff", ".3g"),
                      figure(read, "reuse_floor", ".3g"),
                      figure(read, "ppl_diff_pct", ".3g"), verdict])  # fmt: skip
    headers = ["writer", "reader", "kind", "model", "loads?", "mean |dNLL|", "max |dNLL|",
               "floor", "ppl diff %", "verdict"]  # fmt: skip
    return tabulate(lines, headers=headers, disable_numparse=True)


def progress(message: str, prog: str = PROG) -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def nats(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--writer",
        required=True,
        metavar="PY",
        help="python of the environment whose engine saves the cache",
    )
    p.add_argument(
        "--reader",
        required=True,
        action="append",
        metavar="PY",
        help="python of an environment whose engine loads it (repeatable)",
    )
    p.add_argument(
        "--engine",
        choices=sorted(SAVED_ENGINES),
        default="mlx",
        help="mlx (mlx-lm prompt cache files, the default) or llama_cpp (pickled "
        "llama-cpp-python Llama states)",
    )
    p.add_argument(
        "--kind",
        action="append",
        choices=sorted({k for e in SAVED_ENGINES.values() for k in e.kinds}),
        help="cache kind, repeatable: "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"{k} ({v})" for k, v in e.kinds.items())
            + f" (default: {', '.join(e.default_kinds)})"
            for name, e in SAVED_ENGINES.items()
        ),
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m (default), gemma3-270m, or a GGUF file",
    )
    p.add_argument(
        "--messages",
        type=whole_number(2),
        default=DEFAULT_MESSAGES,
        help=f"the chat's first this many messages are cached (default {DEFAULT_MESSAGES})",
    )
    p.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="the chat template the engine applies: gemma3-it (bundled) or a Jinja file; "
        "default: the model's own (the bundled Gemma 3 base GGUF has none: give gemma3-it)",
    )
    p.add_argument(
        "--cap",
        type=whole_number(1),
        default=DEFAULT_CAP,
        help=f"mlx, rotating: max_size (default {DEFAULT_CAP})",
    )
    p.add_argument(
        "--sinks",
        type=whole_number(0),
        default=DEFAULT_SINKS,
        help=f"mlx, rotating: keep (default {DEFAULT_SINKS})",
    )
    p.add_argument(
        "--reply-tokens",
        type=whole_number(1),
        default=None,
        help=f"forced reply tokens scored (default: mlx {DEFAULT_REPLY_TOKENS}, llama_cpp "
        f"{saved_state.DEFAULT_REPLY_TOKENS}, as edit_replay scores a reuse)",
    )
    p.add_argument(
        "--max-mean-nll-diff",
        type=nats,
        default=MAX_MEAN_ABS_NLL_DIFF,
        metavar="NATS",
        help=f"tolerance (default {MAX_MEAN_ABS_NLL_DIFF:g})",
    )
    p.add_argument(
        "--max-abs-nll-diff",
        type=nats,
        default=MAX_ABS_NLL_DIFF,
        metavar="NATS",
        help=f"tolerance for the worst token (default {MAX_ABS_NLL_DIFF:g})",
    )
    p.add_argument(
        "--max-reuse-excess",
        type=nats,
        default=MAX_REUSE_EXCESS,
        metavar="NATS",
        help=f"llama_cpp: tolerance on the mean |dNLL| beyond llama.cpp's own floor (default "
        f"{MAX_REUSE_EXCESS:g})",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every row as JSON")
    p.add_argument(
        "--timeout",
        type=whole_number(1),
        default=TIMEOUT_S,
        metavar="S",
        help=f"seconds one write or read may take (default {TIMEOUT_S})",
    )
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = parser(prog).parse_args(argv)
    from pytest_kvguard.gate.engine_pythons import check_python
    from pytest_kvguard.inputs.chats import (
        BUNDLED_TEMPLATES,
        DEFAULT_CHAT,
        load_chat_template,
        load_conversation,
    )
    from pytest_kvguard.inputs.models import parse_model

    engine = SAVED_ENGINES[args.engine]
    kinds = list(dict.fromkeys(args.kind or engine.default_kinds))
    foreign = [k for k in kinds if k not in engine.kinds]
    if foreign:
        print(f"{prog}: --kind {foreign[0]} is not a kind of --engine {args.engine} (its kinds: "
              f"{', '.join(engine.kinds)})", file=sys.stderr)  # fmt: skip
        return 2
    if args.sinks >= args.cap and "rotating" in kinds:
        print(f"{prog}: --sinks {args.sinks} leaves no room in --cap {args.cap}", file=sys.stderr)
        return 2
    try:
        writer = check_python(args.writer, "--writer")
        readers = [check_python(r, "--reader") for r in args.reader]
        # A chat too short fails here, before any engine loads.
        chat = load_conversation(DEFAULT_CHAT, Path.cwd())
        if args.messages > len(chat.messages):
            raise KvguardError(
                f"--messages {args.messages}: the {DEFAULT_CHAT} chat has {len(chat.messages)}",
                fix=f"use --messages 2 to {len(chat.messages)}",
            )
        # Resolved here: an engine environment need not have the model's package.
        model = parse_model(args.model, Path.cwd()).resolve()
        common = ["--messages", str(args.messages)]
        if args.engine == "mlx":
            common += ["--cap", str(args.cap), "--sinks", str(args.sinks)]
        if args.chat_template is not None:
            # Read here (a bad file is one line before any engine runs); handed on absolute.
            template = load_chat_template(args.chat_template, Path.cwd())
            bundled = template.name in BUNDLED_TEMPLATES
            common += ["--chat-template", template.name if bundled else str(template.path)]
        tolerance = Tolerance(args.max_mean_nll_diff, args.max_abs_nll_diff,
                              args.max_reuse_excess)  # fmt: skip
        reply_tokens = args.reply_tokens or engine.reply_tokens
        rows = check_matrix(engine, writer, readers, kinds, model, common, reply_tokens,
                            tolerance, args.timeout, prog)  # fmt: skip
    except KvguardError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.engine == "llama_cpp":
        print(
            f"tolerance: mean |dNLL| beyond llama.cpp's own floor <= "
            f"{tolerance.reuse_excess:g} nats over {reply_tokens} forced reply tokens"
        )
    else:
        print(
            f"tolerance: mean |dNLL| <= {tolerance.mean_abs_nll_diff:g} nats and max |dNLL| <= "
            f"{tolerance.max_abs_nll_diff:g} nats over {reply_tokens} forced reply tokens"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 1 if any(r["verdict"] != "PASS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
