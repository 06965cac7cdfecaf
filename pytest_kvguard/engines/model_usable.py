"""Whether a check's model is one its engines can load, told before any run where kvguard can
tell without loading weights: a GGUF file's header (magic, version, tensors within the file),
a model folder's config and tokenizer files, and the architecture against what each engine
declares it loads (``EngineInfo.gguf_architectures``) or, where the adapter has an
``architecture_probe`` and runs in this process, what its library says (llama.cpp: a
vocabulary-only load, which reads the architecture first).
"""

from __future__ import annotations

from collections.abc import Sequence

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines.registry import ENGINES, adapter_function, installed_version
from pytest_kvguard.inputs.gguf_header import read_gguf_header
from pytest_kvguard.inputs.model_folder import folder_facts
from pytest_kvguard.inputs.models import ModelRef


def check_model_usable(model: ModelRef, engines: Sequence[str], here: Sequence[str]) -> None:
    """A one-line KvguardError naming the file and what is wrong, where kvguard can tell.

    ``here``: the engines that run in this Python environment (llama.cpp's own architecture
    list is asked only there: another environment may have another llama.cpp)."""
    if model.form == "folder":
        folder_facts(model.resolve())  # config.json and a tokenizer file, or one line
        return
    if model.form != "gguf":
        return  # a hub id or a server's URL: nothing here to read
    path = model.resolve()
    header = read_gguf_header(path)  # the magic, the version, every tensor inside the file
    arch = header.field("general.architecture")
    if not isinstance(arch, str):
        raise KvguardError(
            f"{path}: GGUF metadata has no general.architecture", fix="re-convert the model"
        )
    for engine in engines:
        known = ENGINES[engine].gguf_architectures
        if known is not None and arch not in known:
            raise KvguardError(
                f"{path}: engine {engine} cannot load GGUF architecture '{arch}' (it loads "
                + ", ".join(known)
                + ")",
                fix=f"use a model of those architectures with engine {engine}, or another engine",
            )
    if model.path is None:
        return  # bundled models are known to load; a user's file is asked of the engine itself
    for engine in engines:
        info = ENGINES[engine]
        if info.architecture_probe is None or engine not in here:
            continue  # another environment may have another release of the engine
        reason = adapter_function(info.architecture_probe)(path)
        if reason is not None:
            raise KvguardError(
                f"{path}: {info.distribution} {installed_version(engine)} cannot load it: {reason}",
                fix=f"upgrade {info.distribution} to a release that knows this architecture",
            )
