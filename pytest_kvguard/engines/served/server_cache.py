"""edit_replay through llama-server: one slot of a server holding a prompt, the follow-up's
reuse the server's own decision and count (``timings.cache_n`` / ``prompt_n``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_kvguard.core.errors import EngineError
from pytest_kvguard.engines.buffer_sizes import buffer_mib
from pytest_kvguard.engines.protocols import Prompt, Reuse
from pytest_kvguard.engines.served.process import ServerSettings, field

if TYPE_CHECKING:
    from pytest_kvguard.engines.served.llama_server import LlamaServerEngine

_CHECKPOINT_SIZE = re.compile(r"created context checkpoint \d+ of \d+ .*?size = ([\d.]+) MiB")
"""A checkpoint llama-server logs (at --log-verbosity 4), with its size."""
SLOT = 0


class ServerPrefixCache:
    """One slot of a server holding a prompt; the follow-up's reuse is the server's own count.

    Implements ``replay`` (the edit_replay scenario calls it instead of keep_prefix and extend):
    llama-server decides what it reuses when the follow-up arrives, and says so in timings.
    """

    def __init__(self, engine: LlamaServerEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        """The server's settings; the first request adds the chat template its prompt came
        from, so the ids and their replay come from one server (``request``)."""
        self.log_start = 0
        """Where this cache's part of the server log starts (its checkpoints, restores)."""

    def _erase(self) -> None:
        """Start from an empty slot: the previous check's prompt must not be reused. Not on an
        existing server: it may serve others, and erasing needs --slot-save-path there; its
        slot then holds whatever it last served, which the first prompt replaces."""
        if self.engine.url is None:
            self.http.post(f"/slots/{SLOT}?action=erase", {})

    def _complete(
        self, token_ids: Sequence[int], reply: Sequence[int] = (), cache_prompt: bool = True
    ) -> tuple[dict[str, Any], np.ndarray]:
        """One /completion of the prompt on the slot: with a reply, each of its tokens forced
        by a grammar of token ids and scored from the probability the server reports for it
        (one free token, unscored, without). The answer and -log p of each reply token."""
        body: dict[str, Any] = {
            "prompt": list(token_ids), "n_predict": max(len(reply), 1),
            "cache_prompt": cache_prompt, "temperature": 0.0, "id_slot": SLOT,
        }  # fmt: skip
        if reply:
            body.update(grammar="root ::= " + " ".join(f"<[{t}]>" for t in reply), n_probs=1,
                        post_sampling_probs=False)  # fmt: skip
        answer = self.http.post("/completion", body)
        if not isinstance(answer, dict):
            raise EngineError(
                f"llama-server's /completion answer is not an object: {answer!r:.120}"
            )
        if not reply:
            return answer, np.zeros(0)
        probs = field(answer, "completion_probabilities", where="/completion")
        if not isinstance(probs, list) or len(probs) != len(reply):
            made = len(probs) if isinstance(probs, list) else "no"
            raise EngineError(f"llama-server generated {made} of {len(reply)} forced tokens")
        nll = []
        for entry, wanted in zip(probs, reply, strict=True):
            if not isinstance(entry, dict) or entry.get("id") != wanted:
                raise EngineError(f"llama-server sampled {entry!r:.60} where {wanted} was forced")
            logprob = entry.get("logprob")
            nll.append(math.inf if logprob is None else -float(logprob))
        return answer, np.array(nll)

    def request(self, prompt: Prompt) -> None:
        """The first request, on a server started with the template the prompt's chat came
        from (as a deployment passes ``--chat-template-file``), its slot emptied first."""
        path = None if prompt.template is None else prompt.template.path
        self.settings = replace(self.settings, chat_template=path)
        self.http = self.engine.serve(self.settings)
        server = self.engine.server
        self.log_start = len(server.log_text()) if server else 0
        self._erase()
        self._complete(prompt.ids)

    def replay(self, prompt: Prompt, reply: Sequence[int]) -> Reuse:
        """Send the follow-up (and the forced reply): reused, re-prefilled and the checkpoint
        restored from the server's ``timings.cache_n``, ``timings.prompt_n`` and its log."""
        token_ids = prompt.ids
        answer, nll = self._complete(token_ids, reply)
        timings = [field(answer, "timings", key, where="/completion")
                   for key in ("cache_n", "prompt_n")]  # fmt: skip
        if not all(isinstance(t, int) for t in timings):
            raise EngineError(f"llama-server's timings are not token counts: {timings!r:.120}")
        reused, reprefilled = timings
        if reused + reprefilled != len(token_ids):
            raise EngineError(
                f"llama-server counted {reused} reused + {reprefilled} processed tokens for a "
                f"{len(token_ids)}-token prompt"
            )
        restored = None
        if self.engine.server is not None:
            log = self.engine.server.log_text()[self.log_start :]
            found = re.findall(r"restored context checkpoint \(.*?n_tokens = (\d+)", log)
            restored = int(found[-1]) if found else None
        return Reuse(reused, reprefilled, restored, nll if reply else None)

    def score_fresh(self, prompt: Prompt, reply: Sequence[int], cut: int = 0) -> np.ndarray:
        """The same request with ``cache_prompt: false``: the server prefills it all again.
        With ``cut``: the first ``cut`` ids prefilled alone (``cache_prompt: false``, so
        nothing the slot held is reused), then the prompt with ``cache_prompt: true``,
        reusing what the server keeps of them."""
        if cut:
            self._complete(prompt.ids[:cut], cache_prompt=False)
            answer, nll = self._complete(prompt.ids, reply)
            cached = field(answer, "timings", "cache_n", where="/completion")
            if not isinstance(cached, int) or cached > cut:
                raise EngineError(f"llama-server reused {cached} tokens of a {cut}-token prompt")
            return nll
        answer, nll = self._complete(prompt.ids, reply, cache_prompt=False)
        cached = answer.get("timings", {}).get("cache_n") if isinstance(answer, dict) else None
        if cached:
            raise EngineError(f"llama-server reused {cached} tokens with cache_prompt: false")
        return nll

    def memory_bytes(self) -> dict[str, float]:
        """The KV buffer the server's context holds and the checkpoints it made since this
        cache opened, both as the server logged them."""
        server = self.engine.server
        if server is None:
            return {"state_bytes": math.nan, "checkpoint_bytes": math.nan, "checkpoints": math.nan}
        log = server.log_text()
        checkpoints = [float(m) * 2**20 for m in _CHECKPOINT_SIZE.findall(log[self.log_start :])]
        most = self.settings.ctx_checkpoints
        kept = checkpoints[-most:] if most else []
        return {
            "state_bytes": buffer_mib([log])["KV"],
            "checkpoint_bytes": float(sum(kept)),
            "checkpoints": float(len(kept)),
        }

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        raise EngineError("a llama-server is sent requests: use request()")

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        raise EngineError("llama-server decides its own reuse: use replay()")

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        raise EngineError("llama-server decides its own reuse: use replay()")

    def close(self) -> None:
        pass  # the server stays up for the next check with the same settings
