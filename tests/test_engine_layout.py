"""The package's shape: layers that import only downwards, no import loops, engines that have what
they declare, no module too long."""

from __future__ import annotations

import ast
import importlib
import typing
from pathlib import Path

import pytest
from conftest import ENGINE_MARKERS, skip_or_fail

from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.engines import CAPABILITIES, ENGINES, PREFIX_CACHE_CAPABILITIES, EngineInfo
from pytest_kvguard.engines.registry import require_installed

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_kvguard"
MAX_LINES = 450


def module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:``: never run, so they cannot close a loop at import."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                # `from package import module` imports the module; `from module import name`
                # the module that defines the name.
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop, as the modules along it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_import_graph_has_no_loops() -> None:
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["pytest_kvguard.engines.llama_cpp.engine"] >= {
        "pytest_kvguard.engines.llama_cpp.group", "pytest_kvguard.engines.llama_cpp.attention"
    }  # the parser sees imports (else an empty graph would pass)  # fmt: skip
    cycle = find_cycle(graph)
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


LAYERS = ("core", "inputs", "engines", "scenarios", "gate", "isolation", "plugin", "cli")
"""The package's folders, lowest first (docs/contributing.md): a module may import its own
layer's modules and those of the layers below it, never one above."""


def layer_of(module: str) -> str:
    """The layer a module belongs to: its top folder (the package's own ``__init__``: core)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "core"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a higher layer, as ``importer -> imported (layer -> layer)``."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return [
        f"{module} -> {target} ({layer_of(module)} -> {layer_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if rank[layer_of(target)] > rank[layer_of(module)]
    ]


def test_every_module_belongs_to_a_layer() -> None:
    strays = sorted(m for m in module_names() if layer_of(m) not in LAYERS)
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


def test_no_layer_imports_one_above_it() -> None:
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["pytest_kvguard.scenarios.stream"] >= {"pytest_kvguard.core.policies"}
    upward = upward_imports(graph)
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


ENGINE_PACKAGES = ("llama_cpp", "mlx", "served")
"""One engine's own code: only the engines layer and those above scenarios may import it."""


def test_scenarios_reach_engines_only_through_their_protocols() -> None:
    """Scenarios, inputs and core call the Engine protocol and the registry, never one engine's
    own package (gate's faults, the plugin and the commands may)."""
    modules = module_names()
    reaching = [
        f"{name} -> {target}"
        for name, path in sorted(modules.items())
        if layer_of(name) in ("core", "inputs", "scenarios")
        for target in sorted(imports_of(name, path, modules))
        if target.split(".")[1:3] in (["engines", p] for p in ENGINE_PACKAGES)
    ]
    assert not reaching, "imports of one engine's own package:\n" + "\n".join(reaching)


def test_an_upward_import_is_found_and_named() -> None:
    graph = {
        "pytest_kvguard.engines.mlx.engine": {"pytest_kvguard.core.policies"},
        "pytest_kvguard.core.budgets": {"pytest_kvguard.scenarios"},
        "pytest_kvguard.inputs.models": {"pytest_kvguard.inputs.texts", "pytest_kvguard"},
    }
    assert upward_imports(graph) == [
        "pytest_kvguard.core.budgets -> pytest_kvguard.scenarios (core -> scenarios)"
    ]


def test_a_loop_is_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def protocol_members(protocol: type) -> set[str]:
    """What a class must have to implement ``protocol``: its methods, properties and fields."""
    own = {n for n in vars(protocol) if not n.startswith("_")}
    return own | set(getattr(protocol, "__annotations__", {}))


def implements(cls: type, protocol: type) -> bool:
    """Whether the class itself (not an instance) has every member the protocol asks for; a
    field counts when the class declares it."""
    declared = typing.get_type_hints(cls)
    return all(hasattr(cls, m) or m in declared for m in protocol_members(protocol))


def adapter_class(info: EngineInfo) -> type:
    """The engine class an adapter's ``load`` returns."""
    module = importlib.import_module(info.module)
    cls = typing.get_type_hints(module.load)["return"]
    assert isinstance(cls, type)
    return cls


def engine_param(engine: str) -> object:
    """The engine, with its marker where importing its adapter needs the engine installed
    (llama_cpp, mlx): tests/conftest.py skips it where the engine is missing, or fails it where
    engines are required. A binary or remote engine's adapter imports without its program."""
    info = ENGINES[engine]
    if engine in ENGINE_MARKERS and not (info.binary or info.remote):
        return pytest.param(engine, marks=getattr(pytest.mark, engine))
    return engine


@pytest.mark.parametrize("engine", [engine_param(engine) for engine in sorted(ENGINES)])
def test_each_engine_has_exactly_the_capabilities_it_declares(
    request: pytest.FixtureRequest, engine: str
) -> None:
    info = ENGINES[engine]
    try:
        require_installed(engine)
    except KvguardError:  # an adapter registered by another package, without its engine
        skip_or_fail(request.config, f"engine {engine} is not installed ({info.install})")
    unknown = info.capabilities - set(CAPABILITIES) - set(PREFIX_CACHE_CAPABILITIES)
    assert not unknown, f"{engine} declares capabilities no protocol defines: {unknown}"
    cls = adapter_class(info)
    has = {name for name, protocol in CAPABILITIES.items() if implements(cls, protocol)}
    cache = typing.get_type_hints(cls.open_prefix_cache)["return"]  # type: ignore[attr-defined]
    has |= {n for n, protocol in PREFIX_CACHE_CAPABILITIES.items() if implements(cache, protocol)}
    assert has == info.capabilities, (
        f"{engine}: {cls.__name__} implements {sorted(has)}, "
        f"the registry declares {sorted(info.capabilities)}"
    )


def test_no_module_is_over_450_lines() -> None:
    lengths = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text(encoding="utf-8").splitlines())
        for path in module_names().values()
    }
    assert lengths, "no modules found"
    too_long = {path: n for path, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
