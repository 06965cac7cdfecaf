"""A conversation past capacity, as an engine's generate entry point meets it.

Turns of a prompt the engine prefills (a message, a tool output) and a reply it generates. The
``generate`` scenario plans the turns; each engine adapter runs them through its own entry point
(``Engine.converse``); ``converse_through_stream`` runs them on a ``Stream`` where an engine's
nearest equivalent is its decode call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pytest_kvguard.core.scoring import nll_of

if TYPE_CHECKING:
    from pytest_kvguard.engines import Stream


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation past capacity: a prompt the engine prefills, then a reply."""

    prompt: int
    """Tokens appended as a prompt (a user message, a tool output): prefilled, not scored."""
    reply: int
    """Tokens then generated one at a time, teacher-forced to the text's own tokens: scored."""


def plan_turns(n_tokens: int, prompt: int, reply: int) -> list[Turn]:
    """Turns of ``prompt`` + ``reply`` tokens over ``[0, n_tokens)``; the last may be short.

    Every turn has a prompt token and a reply token; a single token left at the end is not fed.
    """
    turns, done = [], 0
    while n_tokens - done >= 2:
        turn_prompt = min(prompt, n_tokens - done - 1)
        turn_reply = min(reply, n_tokens - done - turn_prompt)
        turns.append(Turn(turn_prompt, turn_reply))
        done += turn_prompt + turn_reply
    return turns


def converse_through_stream(
    stream: Stream, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
) -> np.ndarray:
    """The turns on a ``Stream``: each prompt but its last token decoded ``prefill_step`` at a
    time without logits (the stream evicts what each call needs), then the last prompt token
    and every reply token one at a time, scoring each reply token.

    Returns nll over ``token_ids[1:]``: nll[i] scores token i+1; NaN where it was not generated.
    """
    nll = np.full(len(token_ids) - 1, np.nan)
    done = 0
    for turn in turns:
        last = done + turn.prompt - 1
        while done < last:
            size = min(prefill_step, last - done)
            stream.feed(token_ids[done : done + size], logits=False)
            done += size
        logits = stream.feed(token_ids[last : last + 1])
        done = last + 1
        for token in token_ids[done : done + turn.reply]:
            nll[done - 1] = nll_of(logits[-1:], np.asarray([token]))[0]
            logits = stream.feed([token])
            done += 1
    return nll
