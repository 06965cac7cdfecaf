"""Engine faults injected at run time, the way real upgrades break KV-cache handling.

Each fault patches the real engine (or the engine call kvguard's adapter makes) for the
duration of a ``with inject(name):`` block, and names the bundled checks that must turn red
under it. ``pytest --kvguard-inject-fault NAME`` runs a whole session under one fault, so a
user can see which of their own checks would catch it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pytest_kvguard.core.errors import KvguardError


@dataclass(frozen=True)
class Fault:
    name: str
    engine: str
    what: str
    """What breaks, as an upgrade would break it."""
    caught_by: tuple[str, ...]
    """Bundled checks that must turn red under this fault (each is in both fixtures/quick.yaml
    and fixtures/budgets.yaml, under the same name)."""
    patch: Callable[[contextlib.ExitStack], None]
    kills_worker: bool = False
    """The engine crashes or hangs: only run it in an engine worker, never in pytest itself."""


def _set(stack: contextlib.ExitStack, owner: Any, name: str, value: Any) -> None:
    """Replace ``owner.name`` until the stack closes."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, original)


def _sinks_dropped(stack: contextlib.ExitStack) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    from pytest_kvguard.engines.mlx import caches as adapter

    class RotatingWithoutKeep(RotatingKVCache):  # type: ignore[misc]
        def __init__(self, max_size: int, keep: int = 0) -> None:
            super().__init__(max_size, keep=0)  # sinks asked for, silently not kept

    _set(stack, adapter, "RotatingKVCache", RotatingWithoutKeep)


def _cap_not_applied(stack: contextlib.ExitStack) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    from pytest_kvguard.engines.mlx import caches as adapter

    class RotatingWithoutCap(RotatingKVCache):  # type: ignore[misc]
        def __init__(self, max_size: int, keep: int = 0) -> None:
            super().__init__(2**31, keep=keep)  # max_size silently ignored

    _set(stack, adapter, "RotatingKVCache", RotatingWithoutCap)


def _positions_not_rebased(stack: contextlib.ExitStack) -> None:
    import llama_cpp as lc

    def seq_add_ignored(memory: Any, seq: int, p0: int, p1: int, delta: int) -> None:
        return None  # survivors keep their old positions after eviction

    _set(stack, lc, "llama_memory_seq_add", seq_add_ignored)


def _swa_full_ignored(stack: contextlib.ExitStack) -> None:
    import llama_cpp as lc
    import llama_cpp.llama_cpp as bindings  # what llama-cpp-python's own Llama calls

    real = lc.llama_init_from_model

    def init_without_swa_full(model: Any, params: Any) -> Any:
        params.swa_full = False  # the flag is accepted and not honoured
        return real(model, params)

    _set(stack, lc, "llama_init_from_model", init_without_swa_full)
    _set(stack, bindings, "llama_init_from_model", init_without_swa_full)


def _checkpoint_not_restored(stack: contextlib.ExitStack) -> None:
    import llama_cpp as lc

    def restore_nothing(ctx: Any, data: Any, size: int, seq: int, flags: int) -> int:
        return 0  # the engine reports that it restored nothing

    _set(stack, lc, "llama_state_seq_set_data_ext", restore_nothing)


def _stale_trim(stack: contextlib.ExitStack) -> None:
    import sys

    import mlx_lm.models.cache as mlx_cache

    from pytest_kvguard.engines.mlx import stream as adapter

    def trim_nothing(cache: Any, num_tokens: int) -> int:
        return num_tokens  # says it trimmed; the old prompt's tail stays in the cache

    _set(stack, mlx_cache, "trim_prompt_cache", trim_nothing)
    _set(stack, adapter, "trim_prompt_cache", trim_nothing)
    server = sys.modules.get("mlx_lm.server")  # LRUPromptCache lived there in 0.29 to 0.31
    if server is not None and hasattr(server, "trim_prompt_cache"):
        _set(stack, server, "trim_prompt_cache", trim_nothing)


def _draft_trim_ignored(stack: contextlib.ExitStack) -> None:
    from mlx_lm.models.cache import KVCache

    def trim_nothing(self: Any, n: int) -> int:
        return int(min(self.offset, n))  # reports the tokens trimmed; the drafts stay

    _set(stack, KVCache, "trim", trim_nothing)


def _window_not_checked(stack: contextlib.ExitStack) -> None:
    from pytest_kvguard.engines.llama_cpp.prefix_cache import LlamaCppPrefixCache

    _set(stack, LlamaCppPrefixCache, "_window_held", lambda self, keep: True)


def execute_illegal_instruction() -> None:
    """Die of SIGILL by executing an undefined instruction, as an engine built for a newer CPU
    does (ud2 on x86-64, udf on arm64); raise the signal where executable memory is refused."""
    import ctypes
    import mmap
    import os
    import platform
    import signal

    code = {"x86_64": b"\x0f\x0b", "AMD64": b"\x0f\x0b", "arm64": b"\0\0\0\0",
            "aarch64": b"\0\0\0\0"}.get(platform.machine())  # fmt: skip
    if code is not None:
        try:
            page = mmap.mmap(
                -1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
            )
            page.write(code)
            address = ctypes.addressof(ctypes.c_char.from_buffer(page))
            ctypes.CFUNCTYPE(None)(address)()
        except (OSError, ValueError):
            pass
    os.kill(os.getpid(), signal.SIGILL)


def _engine_crash(stack: contextlib.ExitStack) -> None:
    import llama_cpp as lc

    def shift_crashes(memory: Any, seq: int, p0: int, p1: int, delta: int) -> None:
        execute_illegal_instruction()

    _set(stack, lc, "llama_memory_seq_add", shift_crashes)


def _engine_hang(stack: contextlib.ExitStack) -> None:
    import threading

    import llama_cpp as lc

    def eviction_never_returns(memory: Any, seq: int, p0: int, p1: int) -> bool:
        threading.Event().wait()  # blocks forever, as a deadlocked engine call does
        return False

    _set(stack, lc, "llama_memory_seq_rm", eviction_never_returns)


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "sinks_dropped",
            "mlx",
            "RotatingKVCache built with keep=0 where the policy asks for sinks",
            ("smollm2-mlx-sink4",),
            _sinks_dropped,
        ),
        Fault(
            "positions_not_rebased",
            "llama_cpp",
            "llama_memory_seq_add does nothing: survivors are not re-based after eviction",
            ("smollm2-sink4-reindexed", "smollm2-window-reindexed"),
            _positions_not_rebased,
        ),
        Fault(
            "cap_not_applied",
            "mlx",
            "RotatingKVCache(max_size) silently grows like a KVCache",
            ("smollm2-mlx-memory-sink4", "smollm2-mlx-sink4"),
            _cap_not_applied,
        ),
        Fault(
            "swa_full_ignored",
            "llama_cpp",
            "the context is created without swa_full although it was asked for",
            ("gemma3-memory-swafull", "gemma3-swafull-edit-middle", "gemma3-swafull-resend-api"),
            _swa_full_ignored,
        ),
        Fault(
            "checkpoint_not_restored",
            "llama_cpp",
            "llama_state_seq_set_data_ext restores nothing from a sliding-layer checkpoint",
            ("gemma3-ckpt-edit-middle",),
            _checkpoint_not_restored,
        ),
        Fault(
            "stale_trim",
            "mlx",
            "trim_prompt_cache reports the tokens trimmed and trims nothing: the follow-up is "
            "decoded after the old prompt's tail, with the same counts",
            ("smollm2-mlx-full-edit-end", "smollm2-mlx-full-edit-end-api"),
            _stale_trim,
        ),
        Fault(
            "draft_trim_ignored",
            "mlx",
            "KVCache.trim reports the tokens trimmed and trims nothing: a draft path's rejected "
            "drafts stay in the full cache",
            ("smollm2-mlx-speculative-full",),
            _draft_trim_ignored,
        ),
        Fault(
            "window_not_checked",
            "llama_cpp",
            "kvguard's memory path keeps a prefix although the sliding layers no longer hold "
            "the window before the split, as llama-cpp-python's Llama does with swa_full=False",
            ("gemma3-swa-resend",),
            _window_not_checked,
        ),
        Fault(
            "engine_crash",
            "llama_cpp",
            "the KV shift after an eviction (llama_memory_seq_add) dies of an illegal instruction",
            ("smollm2-sink4-reindexed", "smollm2-window-reindexed"),
            _engine_crash,
            kills_worker=True,
        ),
        Fault(
            "engine_hang",
            "llama_cpp",
            "evicting from the KV cache (llama_memory_seq_rm) never returns",
            ("smollm2-sink4-reindexed", "smollm2-window-reindexed"),
            _engine_hang,
            kills_worker=True,
        ),
    )
}


def fault(name: str) -> Fault:
    try:
        return FAULTS[name]
    except KeyError:
        raise KvguardError(
            f"unknown fault '{name}'", fix="use one of " + ", ".join(FAULTS)
        ) from None


@contextlib.contextmanager
def inject(name: str) -> Iterator[Fault]:
    """Run the block with the fault in place; everything is restored on the way out."""
    chosen = fault(name)
    with contextlib.ExitStack() as stack:
        chosen.patch(stack)
        yield chosen
