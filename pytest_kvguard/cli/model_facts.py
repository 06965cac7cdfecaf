"""A model's cache-relevant facts, and what differs from a candidate, without loading weights.

    kvguard model-facts MODEL [CANDIDATE] [--json]

MODEL and CANDIDATE are each a bundled model name, a .gguf file or an mlx / Hugging Face model
folder. With a candidate: both side by side, then one line per fact that differs, and where
both are GGUF files, how the bundled chat's first tokens differ as llama-cpp-python's chat call
makes them (each file's own template, special tokens parsed; vocabulary only; needs
llama-cpp-python).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

from pytest_kvguard.core.args import OneLineParser
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines.chat_tokens import CHAT_TOKENS, chat_token_line
from pytest_kvguard.inputs.model_facts import (
    LABELS,
    ModelFacts,
    diff_facts,
    diff_lines,
    fact_rows,
    facts_json,
    read_model_facts,
)
from pytest_kvguard.inputs.models import BUNDLED_MODELS, parse_model


def model_path(value: str) -> Path:
    """A bundled name's GGUF file, or the file or folder as given."""
    ref = parse_model(value, Path.cwd())
    if ref.form in ("hub", "url"):
        raise KvguardError(
            f"'{value}' is a {ref.form} model, whose files kvguard cannot read here",
            fix="give a .gguf file, a model folder, or one of: " + ", ".join(BUNDLED_MODELS),
        )
    return ref.resolve()


def main(argv: Sequence[str] | None = None, *, prog: str = "kvguard-model-facts") -> int:
    parser = OneLineParser(
        prog=prog,
        description="A model's cache-relevant facts (tokenizer BOS/EOS, chat template, sliding "
        "window, heads, rope, weight type, sha256) read without loading weights, and with a "
        "candidate, what differs.",
    )
    parser.add_argument(
        "model", help="a bundled model (" + ", ".join(BUNDLED_MODELS) + "), .gguf file or folder"
    )
    parser.add_argument("candidate", nargs="?", help="the model to compare with it")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--chat-tokens",
        type=int,
        default=CHAT_TOKENS,
        metavar="N",
        help="compare the bundled chat's first N tokens (as the chat call makes them) of two "
        "GGUF files "
        "(default: %(default)s; 0: skip)",
    )
    args = parser.parse_args(argv)
    try:
        models = [_read(args.model)] + ([_read(args.candidate)] if args.candidate else [])
        chat = chat_token_line(models[0], models[1], args.chat_tokens) if len(models) == 2 else None
    except KvguardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_as_json(models) | ({"chat_tokens": chat} if chat else {}), indent=2))
        return 0
    names = [args.model] + ([args.candidate] if args.candidate else [])
    print(tabulate(_side_by_side(models), headers=["fact", *names], disable_numparse=True))
    if len(models) == 2:
        print()
        print("\n".join(diff_lines(diff_facts(*models)) + ([chat] if chat else [])))
    return 0


def _read(value: str) -> ModelFacts:
    return read_model_facts(model_path(value))


def _side_by_side(models: list[ModelFacts]) -> list[list[str]]:
    columns = [dict(fact_rows(facts)) for facts in models]
    return [[label, *(column[label] for column in columns)] for label in LABELS.values()]


def _as_json(models: list[ModelFacts]) -> dict[str, object]:
    if len(models) == 1:
        return {"model": facts_json(models[0])}
    return {
        "model": facts_json(models[0]),
        "candidate": facts_json(models[1]),
        "differences": [
            {"fact": d.fact, "model": d.before, "candidate": d.after} for d in diff_facts(*models)
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
