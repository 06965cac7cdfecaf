"""What scenarios call on an engine: the core ``Engine`` protocol, what it hands out (streams,
stream groups, prefix caches, attention rows), and the optional capabilities an adapter may
add. Scenarios test a capability with ``isinstance`` against these runtime-checkable protocols;
``registry.ENGINES`` declares which each adapter has, and tests/test_engine_layout.py checks
the two agree.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from pytest_kvguard.core.policies import Policy

if TYPE_CHECKING:
    from pytest_kvguard.engines.conversation import Turn
    from pytest_kvguard.inputs.chats import ChatTemplate


@runtime_checkable
class Stream(Protocol):
    """One sequence in an engine's cache, run under one policy."""

    def room(self) -> int | None:
        """Tokens that fit before the policy must evict; None when it never evicts."""
        ...

    def feed(self, token_ids: Sequence[int], logits: bool = True) -> np.ndarray:
        """Evict as the policy says, decode the tokens, return their logits (n, vocab) float32.

        With ``logits=False`` only the cache matters (memory runs): the result may be empty.
        """
        ...

    @property
    def held(self) -> int:
        """KV entries held per layer now."""
        ...

    @property
    def evicted(self) -> int:
        """Tokens evicted so far."""
        ...

    def figures(self) -> dict[str, float]:
        """Engine-measured memory figures now (bytes), e.g. kv_bytes, peak_memory_bytes."""
        ...

    def layer_sizes(self) -> list[tuple[int, int]]:
        """(tokens seen, KV entries held) per layer, where the engine exposes it; else []."""
        ...

    @property
    def quantized_from(self) -> int | None:
        """Tokens fed when the cache first held quantized keys and values (0: from the
        start); None while it holds none."""
        ...

    def close(self) -> None: ...


class StreamGroup(Protocol):
    """Several streams of one engine and model, one policy each, that can decode one more token
    each in one engine call: the weights are read once for all of them (``Engine.
    open_stream_group``). Each row keeps its own real cache, and may be fed its own token ids;
    figures stay per row."""

    @property
    def streams(self) -> Sequence[Stream]:
        """One stream per policy, in order; each can also be fed alone."""
        ...

    def feed_rows(self, rows: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Decode ``token_ids[k]`` on row ``rows[k]`` (index into ``streams``), all in one
        engine call (those rows have been fed as many tokens, so their caches hold as many
        entries, and each has room made for one more as its policy says): the logits, one row
        per token (len(rows), vocab) float32."""
        ...

    def close(self) -> None: ...


class PrefixCache(Protocol):
    """An engine's cache holding one prompt, able to serve an edited prompt (edit_replay).

    It may also snapshot what it holds (``SnapshotsPrefix``) or, on a server, decide its own
    reuse of an edited prompt (``ReplaysPrefix``)."""

    def extend(self, token_ids: Sequence[int], start: int) -> None:
        """Decode ``token_ids`` at positions ``start``, ``start + 1``, ... after the cached ones."""
        ...

    def keep_prefix(self, n_tokens: int) -> tuple[int, int | None]:
        """Trim the cache to the longest prefix of at most ``n_tokens`` the engine can still use.

        Returns the tokens kept and, when a checkpoint was restored to get them, its length.
        """
        ...

    def score(self, token_ids: Sequence[int], start: int) -> np.ndarray:
        """Decode ``token_ids[:-1]`` at positions ``start``, ``start + 1``, ... after the cached
        ones, with logits for each: nll[i] = -log p(token_ids[i + 1]) (len - 1 values)."""
        ...

    def memory_bytes(self) -> dict[str, float]:
        """state_bytes (the cache), checkpoint_bytes, checkpoints (a count)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Reuse:
    """What an engine's own reuse decision did with a follow-up prompt (``ReplaysPrefix``)."""

    reused: int
    """Prompt tokens the engine kept from its cache."""
    reprefilled: int
    """Prompt tokens it decoded again."""
    restored_checkpoint: int | None
    """Tokens covered by the checkpoint it restored, if it did."""
    reply_nll: np.ndarray | None
    """-log p of each forced reply token, generated right after the prompt from that cache;
    None where the engine cannot report token probabilities."""
    window_missing: int | None = None
    """Positions the first re-prefilled token attends to in the sliding layers that the
    cache no longer held when the engine kept its prefix (0: the window was all there); None
    where the engine's state cannot be read."""
    loaded_state: int | None = None
    """Tokens of the state an app's own state cache loaded for the follow-up (llama-cpp-python's
    ``LlamaRAMCache``, ``LlamaDiskCache``, a saved ``LlamaState``); None where none was."""


@dataclass(frozen=True)
class AttentionRows:
    """Attention probabilities an engine computed under the full cache (``Engine.attention``)."""

    probs: np.ndarray
    """(layer, head, query, key position) float32; key positions 0 .. the last query."""
    how: str
    """How they were read, in one line (for the report)."""
    seconds: float
    reconstruction_error: float | None = None
    """Where the probabilities were computed beside a fused kernel: the largest
    |probs @ V - the kernel's output| over the rows read, as a share of what the output's
    dtype allows (above 1: they are not the engine's attention); None where read from the
    engine itself."""
    learned_sinks: bool = False
    """The model has learned sink logits (gpt-oss): rows sum to less than 1."""


@runtime_checkable
class Engine(Protocol):
    """A loaded model in a real inference engine.

    An adapter may also have the optional capabilities below (``ReadsAttention``,
    ``GroupsStreams``, ``ReportsShifts``); ``CAPABILITIES`` names them.
    """

    name: str
    kv_element_bytes: float
    """Bytes per element of the K and V caches (f16: 2)."""

    def version(self) -> str: ...

    def describe(self) -> dict[str, str]:
        """Build and backend facts worth recording in a report."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """Token ids as the engine feeds them, with BOS where the model wants one."""
        ...

    def chat_ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None
    ) -> list[int]:
        """The token ids the engine's own chat call prefills for these messages, as an app
        makes that call: the chat template applied (``template`` as an app passes one; None:
        the model's own), the generation prompt added, special tokens parsed, BOS as the
        vocabulary says."""
        ...

    def open_stream(self, policy: Policy, max_tokens: int) -> Stream:
        """A fresh, empty sequence that will be fed at most ``max_tokens`` tokens."""
        ...

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> PrefixCache:
        """A fresh cache for prompts of at most ``max_tokens`` tokens."""
        ...

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        """The turns through the engine's own generation entry point under ``policy``: each
        prompt prefilled ``prefill_step`` tokens per call, each reply generated with the text's
        next token forced as the sampled one. nll[i] scores token i+1; NaN where not generated.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class ReadsAttention(Protocol):
    """Capability ``attention``: the engine exposes its own attention probabilities."""

    @property
    def bos_id(self) -> int | None:
        """The vocabulary's BOS token; None where it has none."""
        ...

    def attention(
        self, token_ids: Sequence[int], queries: Sequence[int], precision: Policy | None = None
    ) -> AttentionRows:
        """Attention probabilities for those query positions under a full cache, kept at the
        KV precision of ``precision`` (a full policy; None: the engine's default)."""
        ...

    def token_piece(self, token_id: int) -> str:
        """The token's text, special tokens spelt out."""
        ...


@runtime_checkable
class GroupsStreams(Protocol):
    """Capability ``groups``: streams of several policies decode one token each in one engine
    call. Policies with the same non-None ``group_key`` decode together (see
    ``scenarios.feeding.run_specs``)."""

    @property
    def group_figures_own(self) -> bool:
        """Whether a row of a group still reports every figure a stream of its own would, peak
        memory included; where it does not, a run judged by its peak runs alone."""
        ...

    def group_key(self, policy: Policy) -> Hashable | None: ...

    def open_stream_group(self, policies: Sequence[Policy], max_tokens: int) -> StreamGroup: ...


@runtime_checkable
class ReportsShifts(Protocol):
    """Capability ``shifts``: after ``converse``, where the engine shifted its context."""

    @property
    def last_shifts(self) -> Sequence[tuple[int, int, int]]:
        """(n_keep, n_left, n_discard) of each shift in the last ``converse``."""
        ...


@runtime_checkable
class SnapshotsPrefix(Protocol):
    """Prefix-cache capability ``snapshot``: what the cache holds can be saved, and a fresh cache
    of the same policy made to hold it, so edit_replay prefills each chat once per policy."""

    def save(self) -> object:
        """A snapshot of what the cache holds, in the engine's own state format; None where a
        restored snapshot would not predict exactly as the cache it came from."""
        ...

    def restore(self, saved: object) -> None: ...


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: the token ids the engine's chat call prefills for it and, for a
    chat, the messages and template an app hands that call (an API path makes the call itself
    and checks it prefills these ids). A prompt cut short of its chat has no messages."""

    ids: tuple[int, ...]
    messages: tuple[Mapping[str, str], ...] | None = None
    template: ChatTemplate | None = None

    def cut(self, n_tokens: int) -> Prompt:
        """The first ``n_tokens`` ids alone, sent as a plain prompt."""
        return Prompt(self.ids[:n_tokens])


@runtime_checkable
class ReplaysPrefix(Protocol):
    """Prefix-cache capability ``replay``: the engine's own public path (a server, or the API
    apps call) decides its reuse when the edited prompt arrives, and counts it."""

    def request(self, prompt: Prompt) -> None:
        """Send the first prompt as an app does, one token generated: the cache then holds it."""
        ...

    def replay(self, prompt: Prompt, reply: Sequence[int]) -> Reuse:
        """Send the prompt, then generate ``reply`` with each of its tokens forced, scoring
        each from the logits the engine computed with the reused cache."""
        ...

    def score_fresh(self, prompt: Prompt, reply: Sequence[int], cut: int = 0) -> np.ndarray | None:
        """The same prompt and forced reply on the same engine and settings from an empty cache:
        a fresh prefill in the engine's own batches (``cut`` 0, the reference ``replay``'s
        scores are checked against), or, with ``cut``, the prompt's first ``cut`` ids sent as
        a request of their own first and then the prompt reusing them, as a correct reuse cut
        there computes it (the reuse noise floor)."""
        ...


API_STATES = {
    "none": "the Llama keeps the first request's cache and nothing else",
    "ram": "Llama.set_cache(LlamaRAMCache()): each request's state is saved; after another "
    "request in between, the follow-up's is read back (load_state) and its prefix reused",
    "disk": "the same with LlamaDiskCache (each state pickled to a folder)",
    "saved": "Llama.save_state() after the first request, pickled as an app persists it; "
    "after another request, reset() and load_state() of it before the follow-up",
}
"""How the app around llama-cpp-python's ``Llama`` keeps its states between requests
(edit_replay's ``api_state``)."""


@runtime_checkable
class ReusesThroughApi(Protocol):
    """Capability ``api_reuse``: the engine's user-facing API (llama-cpp-python's ``Llama``,
    mlx-lm's prompt cache as its server keeps one) holds a prompt and decides on its own what
    it reuses of the next; ``open_api_cache`` returns a prefix cache with ``replay``."""

    def open_api_cache(self, policy: Policy, max_tokens: int, state: str = "none") -> PrefixCache:
        """A prefix cache held by the API; ``state`` is how the app around it keeps states
        between requests (llama_cpp: none, ram, saved)."""
        ...

    def api_calls(self, state: str = "none") -> str:
        """The public calls the API path makes, in one line (for the report)."""
        ...


@dataclass(frozen=True)
class Decoded:
    """Greedy tokens one call of an engine's generation path emitted (``Speculates``), with
    what the scenario judges them by."""

    tokens: tuple[int, ...]
    """The emitted token ids, in order."""
    logprobs: np.ndarray
    """log p of each emitted token under the logits the engine sampled it from."""
    margins: np.ndarray
    """log p of the best token minus log p of the second best, at each emitted token: how
    far the greedy choice was from a tie."""
    runners_up: tuple[int, ...] | None = None
    """The second-best token at each emitted token (what a flipped near tie emits instead);
    None where the engine does not say."""
    rounds: tuple[tuple[int, int, int], ...] = ()
    """Each verification round of a draft path: (index of the first token it emits, tokens
    drafted, drafts accepted); empty for the plain path."""
    seconds: float = 0.0
    """Wall time of the generation call (prefill included), never gated."""
    held: int | None = None
    """KV entries the target's largest cache layer held at the end; None where unread."""
    refused: str | None = None
    """The engine refused the call (its own error, in one line): no tokens were emitted."""


@runtime_checkable
class Speculates(Protocol):
    """Capability ``speculates``: the engine's own speculative decoding path, greedy, and its
    plain greedy path for the same call (``EngineInfo.speculative_drafts`` names the drafts)."""

    def speculate(
        self,
        policy: Policy,
        prompt: Sequence[int],
        new_tokens: int,
        draft: str | None,
        num_draft: int,
        prefilled: int = 0,
    ) -> Decoded:
        """Generate ``new_tokens`` greedy tokens after ``prompt`` under ``policy`` through the
        engine's public generation call, with ``draft`` (None: the plain path, no draft)
        proposing up to ``num_draft`` tokens per round. With ``prefilled``, the prompt's first
        ``prefilled`` ids are already in the cache when the call starts (a chat's earlier
        turns), and the call gets the rest."""
        ...

    def verification_noise(
        self, prompt: Sequence[int], plain: Decoded, num_draft: int
    ) -> tuple[float, float]:
        """The engine's own noise on a correct (full) cache: the plain path's tokens after
        ``prompt`` verified in batches of ``num_draft + 1``, as a draft path verifies them,
        against decoding them one at a time. Returns the largest |difference| of the emitted
        tokens' log probabilities and of their top-2 margins (nats)."""
        ...


CAPABILITIES: dict[str, type] = {
    "reads_attention": ReadsAttention,
    "speculates": Speculates,
    "groups": GroupsStreams,
    "shifts": ReportsShifts,
    "api_reuse": ReusesThroughApi,
}
"""Optional engine capabilities, by the name ``EngineInfo.capabilities`` declares them with."""

PREFIX_CACHE_CAPABILITIES: dict[str, type] = {
    "snapshot": SnapshotsPrefix,
    "replay": ReplaysPrefix,
}
"""Optional capabilities of an engine's prefix cache (what ``open_prefix_cache`` returns)."""
