"""The package's import graph: no cycles, and the build side never imports serving or the backend runtime.

Read from the source with ``ast`` (every ``import`` statement, at module level or inside a function), so
the test needs none of the optional dependencies the modules import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The package's folders (pyproject.toml's package-dir).
PACKAGE_DIRS = {"model_factory": ROOT / "model_factory", "model_factory.cli": ROOT / "cli",
                "model_factory.build_engines": ROOT / "build_engines",
                "model_factory.backend": ROOT / "backends" / "python_backend"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if any(name.startswith(other + ".") or name == other for other in PACKAGE_DIRS
                   if other != package and other.startswith(package + ".")):
                continue  # a folder mapped to another package name (none today; kept for safety)
            found[name] = path
    return found


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The package module ``name`` is, or lies in (``a.b.c`` imported as a name from ``a.b``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (an import of a package counts as its __init__)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                owner = _owner(target)
                if owner is not None and owner != name:
                    edges.add(owner)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _parents_removed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first; those edges are Python's, not ours,
    # and a package __init__ that re-exports its own submodules is not a cycle between concerns.
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def test_the_walk_finds_the_package() -> None:
    graph = import_graph()
    assert "model_factory.serving.verified_start" in graph and "model_factory.backend.contract" in graph
    assert "model_factory.backend.contract" in graph["model_factory.backend.settings"]


def test_no_import_cycle_among_model_factory_modules() -> None:
    cycle = _cycle(_parents_removed(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("side", ["model_factory.build_engines", "model_factory.build"])
def test_build_code_never_imports_serving_or_the_backend_runtime(side: str) -> None:
    """Build stages and packaging may use the backend's contract (file names, parameters), nothing else of it.

    Packaging copies the backend folder as files (repository.backend_source_dir), which imports only the
    package's ``__init__`` to find it. One module is the exception, on purpose: ``build.loadcheck`` runs the
    packaged model through the backend's own load path (what builds must also serve, issue 20).
    """
    allowed = {"model_factory.backend", "model_factory.backend.contract", "model_factory.backend.lora_contract",
               "model_factory.backend.accuracy_gate"}
    # The LoRA check runs the base graph rewritten as the backend serves it (generation/lora.py).
    on_purpose = {"model_factory.build.loadcheck": {"model_factory.backend.engines.loading", "model_factory.backend.settings"},
                  "model_factory.build_engines.lora": {"model_factory.backend.generation.lora"}}
    graph = import_graph()
    bad = {f"{m} -> {t}" for m, targets in graph.items() if m == side or m.startswith(side + ".")
           for t in targets - on_purpose.get(m, set())
           if t.startswith("model_factory.serving") or (t.startswith("model_factory.backend") and t not in allowed)}
    assert not bad, sorted(bad)


# The backend's rooms, lowest first: a room imports only the rooms below it (and the top-level shared modules).
BACKEND = "model_factory.backend"
BACKEND_ROOMS = ("memory", "requests", "batching", "engines", "operations", "generation")
# At the top, beside the rooms: what every room may use (one definition each), and Triton's entry points.
BACKEND_SHARED = ("contract", "accuracy_gate", "settings", "integrity", "lora_contract")
BACKEND_ENTRY_POINTS = ("model", "generate_model", "prompt_model")
# Modules over this many lines are split (tests and benchmarks aside).
MAX_MODULE_LINES = 650


def _backend_place(module: str) -> str | None:
    """The room (or top-level module) of a backend module, None outside the backend."""
    if not module.startswith(BACKEND + "."):
        return None
    return module[len(BACKEND) + 1:].split(".")[0]


def test_the_backend_is_only_rooms_shared_modules_and_entry_points() -> None:
    places = {_backend_place(m) for m in MODULES} - {None}
    assert places == set(BACKEND_ROOMS) | set(BACKEND_SHARED) | set(BACKEND_ENTRY_POINTS), sorted(places)
    for room in BACKEND_ROOMS:  # each room says what it owns
        doc = ast.get_docstring(ast.parse(MODULES[f"{BACKEND}.{room}"].read_text()))
        assert doc and len(doc) > 80, f"{room}/__init__.py needs a docstring saying what the room owns"


def test_backend_arrows_run_from_the_entry_points_down_through_the_rooms() -> None:
    graph = _parents_removed(import_graph())
    rank = {room: i for i, room in enumerate(BACKEND_ROOMS)}
    bad = []
    for module, targets in graph.items():
        src = _backend_place(module)
        if src is None:
            continue
        for target in targets:
            dst = _backend_place(target)
            if dst is None or dst == src:
                continue
            if dst in BACKEND_ENTRY_POINTS and src not in BACKEND_ENTRY_POINTS:
                bad.append(f"{module} -> {target} (only an entry point hands over to another)")
            elif src in BACKEND_SHARED and dst not in BACKEND_SHARED:
                bad.append(f"{module} -> {target} (a shared module imports only shared modules)")
            elif src in rank and dst in rank and rank[dst] > rank[src]:
                bad.append(f"{module} -> {target} (a room imports only the rooms below it)")
    assert not bad, bad


def test_no_backend_module_is_too_long_to_read() -> None:
    roots = [ROOT / "model_factory", ROOT / "cli", ROOT / "build_engines", ROOT / "backends" / "python_backend"]
    long = {str(p.relative_to(ROOT)): n for root in roots for p in root.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
