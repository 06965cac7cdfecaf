"""Engine adapter ``llama_server``: llama.cpp's own HTTP server, as production deployments run it.

Either kvguard starts a real ``llama-server`` binary with the settings a check implies (context
size, ``--swa-full``, ``--ctx-checkpoints``, context shift), waits until ``/health`` answers and
stops it when done; or a check names an existing server by its URL (``model: http://host:port``)
and kvguard reads its settings from ``/props`` and refuses checks they contradict.

Everything is measured through the server's own API:

- **edit_replay**: both prompts are sent to ``/completion`` as token ids with ``cache_prompt``;
  the follow-up's reuse is the server's own ``timings.cache_n`` and ``timings.prompt_n``.
- **generate** past capacity: one request, the first turn's tokens as the prompt and every
  later token *generated* with a grammar of token ids (``root ::= <[id]> <[id]> ...``) forcing
  the text's own token as the sampled one. ``n_probs: 1`` with ``post_sampling_probs: false``
  makes the server report each sampled token's probability under its raw logits (a softmax over
  the whole vocabulary, before any sampler), so the forced token is scored exactly as the other
  engines score it. The server shifts its context as it generates (``--context-shift``,
  ``n_keep`` = the policy's sinks, ``n_discard`` = its evict step).
- **memory**: the KV buffer llama.cpp logs when the server creates its context and the
  checkpoint sizes it logs (a server kvguard started; an existing one's log is not ours).

The process and HTTP plumbing is in ``process``: no engine package is needed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pytest_kvguard.core.errors import EngineError, KvguardError
from pytest_kvguard.core.policies import Policy
from pytest_kvguard.engines.conversation import Turn
from pytest_kvguard.engines.options import EngineOptions
from pytest_kvguard.engines.protocols import Decoded
from pytest_kvguard.engines.served import server_speculative
from pytest_kvguard.engines.served.process import (
    DEFAULT_REQUEST_TIMEOUT,
    REQUEST_TIMEOUT_ENV,
    Http,
    ServerProcess,
    ServerSettings,
    chat_ids_of,
    field,
    find_binary,
    own_template,
    seconds_from_env,
)
from pytest_kvguard.engines.served.server_cache import SLOT, ServerPrefixCache
from pytest_kvguard.inputs.chats import ChatTemplate, NoChatTemplate
from pytest_kvguard.inputs.models import gguf_chat_template, is_url

TOKENIZE_CTX = 512
"""Context of the server started only to tokenize and render chats."""


def load(target: Path | str, options: EngineOptions) -> LlamaServerEngine:
    return LlamaServerEngine(target, options)


class LlamaServerEngine:
    """llama-server, started per settings (one process at a time) or already running at a URL."""

    name = "llama_server"
    kv_element_bytes = 2.0
    """llama-server's default cache type, f16."""
    last_shifts: list[tuple[int, int, int]]
    """(n_keep, n_left, n_discard) of each shift in the last converse (a started server)."""

    def __init__(self, target: Path | str, options: EngineOptions) -> None:
        self.options = options
        self.url = str(target) if is_url(str(target)) else None
        self.model_path = None if self.url else Path(target)
        self.binary = None if self.url else find_binary()
        self.server: ServerProcess | None = None
        self.http: Http | None = None
        if self.url:
            self.http = Http(self.url, seconds_from_env(REQUEST_TIMEOUT_ENV,
                             DEFAULT_REQUEST_TIMEOUT))  # fmt: skip
        self._props: dict[str, Any] | None = None
        self._adds_bos: bool | None = None
        self.last_shifts = []

    # -- servers ---------------------------------------------------------------------------

    def serve(self, settings: ServerSettings | None) -> Http:
        """A server with these settings (None: any), started if kvguard starts servers;
        an existing server's settings checked against them."""
        if self.url:
            assert self.http is not None
            if settings is not None:
                self._check_existing(settings)
            return self.http
        if self.server is not None and self.server.process.poll() is not None:
            # It died during an earlier check, which reported it: start afresh for this one.
            self.server.stop()
            self.server = None
        if self.server is not None and (settings is None or self.server.settings == settings):
            return self.server.http
        if self.server is not None:
            self.server.stop()  # one at a time: each holds the model and its own cache
            self.server = None
        assert self.binary is not None and self.model_path is not None
        self.server = ServerProcess(
            self.binary, self.model_path, settings or ServerSettings(TOKENIZE_CTX), self.options
        )
        self._props = None
        return self.server.http

    def props(self) -> dict[str, Any]:
        if self._props is None:
            answer = self.serve(None).get("/props")
            if not isinstance(answer, dict):
                raise EngineError(f"llama-server's /props answer is not an object: {answer!r:.120}")
            self._props = answer
        return self._props

    def slot_n_ctx(self) -> int:
        return int(field(self.props(), "default_generation_settings", "n_ctx", where="/props"))

    def _check_existing(self, settings: ServerSettings) -> None:
        """Refuse a check the running server's /props contradict (it cannot be restarted)."""
        props = self.props()
        slots = int(field(props, "total_slots", where="/props"))
        n_ctx = self.slot_n_ctx()
        where = f"the llama-server at {self.url}"
        if settings.context_shift:
            if n_ctx != settings.n_ctx:
                raise KvguardError(
                    f"{where} gives each slot {n_ctx} tokens of context; this check's cap needs "
                    f"{settings.n_ctx} (cap + 1: the server shifts when one more token would "
                    "not fit)",
                    fix=f"use cap: {n_ctx - 1}, or start the server with --ctx-size "
                    f"{settings.n_ctx * slots} --parallel {slots}",
                    key="params.cap",
                )
        elif n_ctx < settings.n_ctx:
            raise KvguardError(
                f"{where} gives each slot {n_ctx} tokens of context; this check needs "
                f"{settings.n_ctx}",
                fix=f"start the server with --ctx-size {settings.n_ctx * slots} or more",
            )

    def version(self) -> str:
        info = self.props().get("build_info")
        return str(info) if info else "unknown"

    def describe(self) -> dict[str, str]:
        facts = {"engine": f"llama-server {self.version()}"}
        if self.url:
            facts["url"] = self.url
        else:
            facts["binary"] = str(self.binary)
            facts["n_threads"] = str(self.options.n_threads)
            facts["n_gpu_layers"] = str(self.options.n_gpu_layers)
        return facts

    # -- text ------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        # As the in-process engines tokenize plain text: BOS where the model wants one,
        # special-token text not parsed.
        body = {"content": text, "add_special": True, "parse_special": False}
        tokens = field(self.serve(None).post("/tokenize", body), "tokens", where="/tokenize")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineError(f"llama-server's /tokenize gave no list of ids: {str(tokens)[:120]}")
        return tokens

    def chat_ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None
    ) -> list[int]:
        """The server's own chat path (``chat_ids_of``), on a server started with the
        template given (``--chat-template-file``)."""
        if template is not None and self.url:
            raise own_template(self.url)
        model = self.model_path
        if template is None and model is not None and gguf_chat_template(model) is None:
            raise NoChatTemplate(model.name)  # the server would fall back to chatml
        path = None if template is None else template.path
        running = self.server.settings if self.server is not None else None
        if self.url or (running is not None and running.chat_template == path):
            http = self.serve(None)
        else:
            http = self.serve(ServerSettings(TOKENIZE_CTX, chat_template=path))
        return chat_ids_of(http, messages)

    def adds_bos(self) -> bool:
        """Whether the model's tokenizer puts a BOS first (llama-server then keeps one token
        more than ``n_keep`` when it shifts)."""
        if self._adds_bos is None:
            with_special = self.serve(None).post("/tokenize", {"content": "a", "add_special": True})
            without = self.serve(None).post("/tokenize", {"content": "a", "add_special": False})
            self._adds_bos = len(field(with_special, "tokens", where="/tokenize")) > len(
                field(without, "tokens", where="/tokenize")
            )
        return self._adds_bos

    # -- edit_replay -----------------------------------------------------------------------

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> ServerPrefixCache:
        settings = ServerSettings(
            n_ctx=max_tokens + 1,
            swa_full=policy.kind == "swa_full",
            ctx_checkpoints=policy.checkpoints,
            checkpoint_min_step=policy.checkpoint_step if policy.checkpoints else 0,
            cache_type_k=policy.cache_type_k,
            cache_type_v=policy.cache_type_v,
        )
        return ServerPrefixCache(self, settings)

    # -- generate --------------------------------------------------------------------------

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        """One /completion request: the first turn's prompt prefilled by the server, every
        later token generated with the text's token forced by a grammar of token ids. Later
        turns' prompt tokens are generated too (the server shifts its context only while it
        generates) but not scored; reply tokens are scored from the server's reported
        probability of the forced token. A ``full`` policy gets a context that never shifts.
        """
        del prefill_step  # the server prefills the prompt in its own batches (UBATCH)
        prompt = turns[0].prompt
        forced = list(token_ids[prompt : sum(t.prompt + t.reply for t in turns)])
        if policy.cap is None:
            settings = ServerSettings(n_ctx=len(token_ids) + 1, cache_type_k=policy.cache_type_k,
                                      cache_type_v=policy.cache_type_v)  # fmt: skip
            keep: int | None = 0
            discard = 0
        else:
            settings = ServerSettings(n_ctx=policy.cap + 1, context_shift=True,
                                      cache_type_k=policy.cache_type_k,
                                      cache_type_v=policy.cache_type_v)  # fmt: skip
            keep, discard = self._keep_and_discard(policy)
            if prompt >= policy.cap:
                raise KvguardError(
                    f"the first prompt ({prompt} tokens) does not fit the cap {policy.cap}: "
                    "llama-server refuses a prompt longer than its context",
                    fix="lower params.prompt below the cap",
                    key="params.prompt",
                )
        http = self.serve(settings)
        self._check_context(settings)
        body: dict[str, Any] = {
            "prompt": list(token_ids[:prompt]), "n_predict": len(forced), "cache_prompt": False,
            "grammar": "root ::= " + " ".join(f"<[{t}]>" for t in forced),
            "n_probs": 1, "post_sampling_probs": False, "temperature": 0.0, "id_slot": SLOT,
        }  # fmt: skip
        if keep is not None:
            body.update(n_keep=keep, n_discard=discard)
        log_start = len(self.server.log_text()) if self.server else 0
        answer = http.post("/completion", body)
        probs = field(answer, "completion_probabilities", where="/completion")
        if not isinstance(probs, list) or len(probs) != len(forced):
            made = len(probs) if isinstance(probs, list) else "no"
            stop = answer.get("stop_type") if isinstance(answer, dict) else None
            raise EngineError(
                f"llama-server generated {made} of {len(forced)} forced tokens (stop: {stop})",
                fix="check the server's log",
            )
        nll = np.full(len(token_ids) - 1, np.nan)
        scored = _reply_positions(turns)
        for offset, (entry, wanted) in enumerate(zip(probs, forced, strict=True)):
            got = entry.get("id") if isinstance(entry, dict) else entry
            if got != wanted:
                raise EngineError(
                    f"llama-server sampled token {got!r} where the grammar forced {wanted} "
                    f"(token {prompt + offset})"
                )
            position = prompt + offset  # the token scored; nll[i] scores token i + 1
            if position in scored:
                logprob = entry.get("logprob")
                # A probability that underflowed to 0 is written as null (log 0 = -inf).
                nll[position - 1] = math.inf if logprob is None else -float(logprob)
        self.last_shifts = self._shifts(log_start)
        return nll

    def _keep_and_discard(self, policy: Policy) -> tuple[int | None, int]:
        """The request's n_keep and n_discard for a capped policy. llama-server keeps n_keep
        tokens, one more where the model adds a BOS; engine_default leaves both to the server
        (its own n_keep, default 0, and half of what is left)."""
        if policy.kind == "engine_default":
            return None, 0  # not sent: the server's own
        bos = 1 if self.adds_bos() else 0
        if policy.sinks < bos:
            raise KvguardError(
                "llama-server always keeps the BOS when it shifts (n_keep counts it on top), so "
                "it cannot run a window without one on this model",
                fix="use policy: sink with sinks: 1 (the BOS alone), or engine_default",
                key="policy",
            )
        return policy.sinks - bos, policy.evict_step

    def _check_context(self, settings: ServerSettings) -> None:
        n_ctx = self.slot_n_ctx()
        if settings.context_shift and n_ctx != settings.n_ctx:
            raise EngineError(
                f"llama-server gave its slot {n_ctx} tokens of context where {settings.n_ctx} "
                "was asked: it would shift at another length than the cap",
                fix="use a cap llama.cpp does not round (cap + 1 a multiple of 256 is safe)",
            )

    def _shifts(self, log_start: int) -> list[tuple[int, int, int]]:
        """(n_keep, n_left, n_discard) of each context shift a started server logged since."""
        if self.server is None:
            return []
        found = re.findall(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)",
                           self.server.log_text()[log_start:])  # fmt: skip
        return [(int(a), int(b), int(c)) for a, b, c in found]

    # -- speculative -----------------------------------------------------------------------

    def speculate(
        self, policy: Policy, prompt: Sequence[int], new_tokens: int, draft: str | None,
        num_draft: int, prefilled: int = 0,
    ) -> Decoded:  # fmt: skip
        """The server with the draft model (``--model-draft``) against the same server
        without it (``server_speculative``)."""
        return server_speculative.speculate(
            self, policy, prompt, new_tokens, draft, num_draft, prefilled
        )

    def verification_noise(
        self, prompt: Sequence[int], plain: Decoded, num_draft: int
    ) -> tuple[float, float]:
        return server_speculative.verification_noise(self, prompt, plain, num_draft)

    # -- not through HTTP ------------------------------------------------------------------

    def open_stream(self, policy: Policy, max_tokens: int) -> Any:
        raise KvguardError(
            "llama-server returns no logits for prompt tokens, so kvguard's own streaming loop "
            "cannot run through it",
            fix="use scenario generate (the server's own generation past capacity) or "
            "edit_replay with engine llama_server",
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _reply_positions(turns: Sequence[Turn]) -> set[int]:
    """Indices of the tokens the turns generate as replies (the ones scored)."""
    positions: set[int] = set()
    done = 0
    for turn in turns:
        done += turn.prompt
        positions.update(range(done, done + turn.reply))
        done += turn.reply
    return positions
