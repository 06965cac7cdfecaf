"""mlx-lm adapter: policies are mlx-lm's own cache classes, used as mlx-lm ships them.

full = ``KVCache``; sink = ``RotatingKVCache(cap, keep=S)``; window = ``RotatingKVCache(cap,
keep=0)``; swa = the model's own ``make_cache()``; engine_default =
``make_prompt_cache(model, max_kv_size=cap)`` exactly as mlx-lm users call it. mlx-lm stores keys
already rotated at their absolute position, so positions are always ``absolute``.

On Linux, OpenBLAS is preloaded before mlx where installed (see ``engines/mlx/blas.py``).
"""

from __future__ import annotations

from pytest_kvguard.engines.mlx.blas import preload_openblas

BLAS_PATH = preload_openblas()

# The engine is imported only after the BLAS choice above.
import importlib.metadata  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache  # noqa: E402

from pytest_kvguard.core.errors import EngineError, KvguardError  # noqa: E402
from pytest_kvguard.core.policies import Policy  # noqa: E402
from pytest_kvguard.engines.conversation import Turn  # noqa: E402
from pytest_kvguard.engines.mlx.api_cache import MlxApiCache, api_calls  # noqa: E402
from pytest_kvguard.engines.mlx.attention import read_attention  # noqa: E402
from pytest_kvguard.engines.mlx.caches import make_caches  # noqa: E402
from pytest_kvguard.engines.mlx.gguf import load_gguf_model  # noqa: E402
from pytest_kvguard.engines.mlx.stream import MlxPrefixCache, MlxStream, MlxStreamGroup  # noqa: E402
from pytest_kvguard.engines.options import EngineOptions  # noqa: E402
from pytest_kvguard.engines.protocols import AttentionRows, Decoded  # noqa: E402
from pytest_kvguard.inputs.chats import ChatTemplate, NoChatTemplate  # noqa: E402


def load(model_path: Path, options: EngineOptions) -> MlxEngine:
    return MlxEngine(model_path, options)


def _apply_chat_template(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None
) -> list[int]:
    """The folder's tokenizer applying its template (or ``template``), generation prompt added."""
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise NoChatTemplate(str(getattr(tokenizer, "name_or_path", "the model")))
    extra = {} if template is None else {"chat_template": template.source}
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **extra)
    except (ValueError, TypeError) as exc:  # no template, a template that raises
        raise EngineError(
            f"mlx-lm's tokenizer could not apply a chat template: {exc}",
            fix="give the check params.chat_template (a Jinja file)",
        ) from None
    # transformers 5 returns a BatchEncoding where 4 returned the ids.
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _gguf_tokenizer(path: Path) -> Any:
    """llama.cpp's own tokenizer for the GGUF (vocab only): both engines see the same ids."""
    try:
        from pytest_kvguard.engines.gguf_vocab import GgufVocab
    except ImportError:
        raise KvguardError(
            "tokenizing a GGUF model for mlx needs llama-cpp-python (vocab only)",
            fix='pip install "pytest-kvguard[llama]"',
        ) from None
    return GgufVocab(path)


class MlxEngine:
    name = "mlx"
    bos_id: int | None
    """The vocabulary's BOS token (set when the model loads); None where it has none."""

    def __init__(self, model_path: Path, options: EngineOptions) -> None:
        self.model_path = model_path
        self.options = options
        if model_path.is_file():
            self.model, self.facts = load_gguf_model(model_path)
            self._tokenizer = _gguf_tokenizer(model_path)
            self._encode = self._tokenizer.tokenize
            self._chat_ids = self._tokenizer.chat_ids
            self._piece = self._tokenizer.token_piece
            self.bos_id = self._tokenizer.bos_id
        else:
            # An mlx-lm model folder, or a hub id on machines that can reach the hub.
            from mlx_lm import load as mlx_load

            self.model, tokenizer = mlx_load(str(model_path))[:2]
            self.facts = {"weights": "mlx_lm.load", "architecture": self.model.model_type}
            self._encode = tokenizer.encode
            self._piece = lambda token_id: tokenizer.decode([token_id])
            self.bos_id = tokenizer.bos_token_id
            self._chat_ids = lambda messages, template: _apply_chat_template(
                tokenizer, messages, template
            )
        self._group_keys: dict[Policy, tuple[str, int] | None] = {}
        self.kv_element_bytes = float(_float_dtype(self.model).size)
        self.weight_bytes = float(_weight_bytes(self.model))
        """Caches take the activations' dtype: float32 for a dequantized GGUF, else the model's."""

    def version(self) -> str:
        return importlib.metadata.version("mlx-lm")

    def describe(self) -> dict[str, str]:
        return {
            "engine": f"mlx-lm {self.version()}, mlx {importlib.metadata.version('mlx')}",
            "device": str(mx.default_device()),
            "blas": BLAS_PATH,
            **self.facts,
        }

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def chat_ids(
        self, messages: Sequence[Mapping[str, str]], template: ChatTemplate | None = None
    ) -> list[int]:
        """An mlx-lm model folder: its tokenizer's ``apply_chat_template`` with the generation
        prompt, as ``mlx_lm.server`` calls it; a GGUF (no mlx-lm tokenizer): the ids
        llama-cpp-python's chat call prefills, so both engines are fed the same."""
        return [int(t) for t in self._chat_ids(messages, template)]

    def token_piece(self, token_id: int) -> str:
        return str(self._piece(token_id))

    def attention(
        self, token_ids: Sequence[int], queries: Sequence[int], precision: Policy | None = None
    ) -> AttentionRows:
        """The softmax of the queries and keys mlx-lm's layers pass (``attention``), over a
        cache quantized as the precision's ``kv_bits`` say."""
        return read_attention(self.model, token_ids, queries, precision)

    def open_stream(self, policy: Policy, max_tokens: int) -> MlxStream:
        return MlxStream(self, policy)

    group_figures_own = True
    """A row of a stream group reports its own memory figures: its cache's bytes throughout,
    mlx's peak and active memory as measured over the calls it makes alone (its fill and first
    one-token call), which settle them for a cache whose every layer rotates."""

    def group_key(self, policy: Policy) -> tuple[str, int] | None:
        """Policies with the same key decode together (``open_stream_group``): every layer a
        ``RotatingKVCache`` of one size. Such caches, fed a token at a time once full, hold as
        many entries at every step whatever their ``keep``, so their keys stack along the batch
        dimension; and once full they grow no more, so a row's memory measured up to then is
        its run's. None for anything else (a layer that keeps everything, or rotates at another
        size, goes on growing past the point where the row joins the group)."""
        if policy.chunk != 1 or policy.kind == "full" or policy.precision_set:
            return None  # a quantized cache returns packed tuples: its rows do not stack
        if policy not in self._group_keys:
            try:
                caches = make_caches(self.model, policy)
            except KvguardError:
                caches = []
            sizes = {int(c.max_size) for c in caches if isinstance(c, RotatingKVCache)}
            rotating = bool(caches) and all(isinstance(c, RotatingKVCache) for c in caches)
            self._group_keys[policy] = (
                ("rotating", sizes.pop()) if rotating and len(sizes) == 1 else None
            )
        return self._group_keys[policy]

    def open_stream_group(self, policies: Sequence[Policy], max_tokens: int) -> MlxStreamGroup:
        keys = {self.group_key(p) for p in policies}
        if None in keys or len(keys) != 1:
            raise ValueError(f"these policies cannot decode together: {policies}")
        return MlxStreamGroup(self, policies)

    def open_prefix_cache(self, policy: Policy, max_tokens: int) -> MlxPrefixCache:
        return MlxPrefixCache(self, policy)

    def open_api_cache(self, policy: Policy, max_tokens: int, state: str = "none") -> MlxApiCache:
        return MlxApiCache(self, policy)  # states kept by the app: llama_cpp only

    def api_calls(self, state: str = "none") -> str:
        return api_calls()

    def converse(
        self, policy: Policy, token_ids: Sequence[int], turns: Sequence[Turn], prefill_step: int
    ) -> np.ndarray:
        """The turns through ``mlx_lm.generate.generate_step``, as mlx-lm's own generate and
        server call it: one prompt cache for the conversation (for ``engine_default`` exactly
        what ``generate_step(max_kv_size=cap)`` builds), each prompt prefilled in steps of
        ``prefill_step_size``, each reply generated by a sampler that returns the text's next
        token (teacher forcing through the public sampler hook), scored from the log
        probabilities generate_step yields.
        """
        from mlx_lm.generate import generate_step

        cache = make_caches(self.model, policy)
        nll = np.full(len(token_ids) - 1, np.nan)
        done = 0
        for turn in turns:
            prompt = mx.array(list(token_ids[done : done + turn.prompt]))
            done += turn.prompt
            reply = list(token_ids[done : done + turn.reply])
            # generate_step samples once more than it yields (that token is never fed): any id.
            forced = iter([*reply, reply[-1]])
            steps = generate_step(
                prompt,
                self.model,
                prompt_cache=cache,
                prefill_step_size=prefill_step,
                sampler=lambda logprobs, forced=forced: mx.array([next(forced)]),
                max_tokens=len(reply),
            )
            try:
                for k, (_, logprobs) in enumerate(steps):
                    nll[done + k - 1] = -float(logprobs[reply[k]].astype(mx.float32).item())
            except (RuntimeError, ValueError) as exc:
                raise EngineError(f"mlx-lm generate_step failed: {exc}") from None
            done += len(reply)
        return nll

    def load_weights_again(self) -> Any:
        """A second copy of the model's weights, as loaded (a draft quantizes its own)."""
        if self.model_path.is_file():
            return load_gguf_model(self.model_path)[0]
        from mlx_lm import load as mlx_load

        return mlx_load(str(self.model_path))[0]

    def speculate(
        self, policy: Policy, prompt: Sequence[int], new_tokens: int, draft: str | None,
        num_draft: int, prefilled: int = 0,
    ) -> Decoded:  # fmt: skip
        """mlx-lm's ``speculative_generate_step`` (or, with no draft, ``generate_step``)."""
        from pytest_kvguard.engines.mlx.speculative import speculate

        return speculate(self, policy, prompt, new_tokens, draft, num_draft, prefilled)

    def verification_noise(
        self, prompt: Sequence[int], plain: Decoded, num_draft: int
    ) -> tuple[float, float]:
        from pytest_kvguard.engines.mlx.speculative import verification_noise

        return verification_noise(self, prompt, plain, num_draft)

    def close(self) -> None:
        self.model = None
        self.__dict__.pop("_drafts", None)
        mx.clear_cache()


def _weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(int(value.nbytes) for _, value in tree_flatten(model.parameters()))


def _float_dtype(model: Any) -> Any:
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32
