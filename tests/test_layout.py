"""The package's layers: no module imports, even lazily inside a function, a module that
imports it back (directly or through others). Lower layers never reach up."""

from __future__ import annotations

import ast
from pathlib import Path

import bitformat

ROOT = Path(bitformat.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every bitformat module ``path`` imports anywhere in its body (package inits excluded:
    importing ``a.b`` runs ``a``'s init, which is not a dependency of the importer's layer)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found.update(t for t in targets if t.startswith("bitformat"))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = {m for m, p in files.items() if p.name != "__init__.py"}
    graph = {}
    for m in modules:
        deps = set()
        for t in _imports(files[m], m):
            # "from .x import y": y may be a module or a name in x
            deps.add(t if t in modules else t.rpartition(".")[0])
        graph[m] = {d for d in deps if d in modules and d != m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    graph = _graph()
    assert "bitformat.runtime.cpu.backend" in graph  # the walk saw the runtime's packages
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_formats_and_codecs_do_not_import_the_runtime_or_the_cli():
    """The layers of docs/architecture.md: containers, codecs, files and tokenizers sit below
    the runtime and the commands."""
    graph = _graph()
    for m, deps in graph.items():
        if m.startswith(("bitformat.formats", "bitformat.codecs", "bitformat.io",
                         "bitformat.tokenizers", "bitformat.graph", "bitformat.families")):
            bad = {d for d in deps if d.startswith(("bitformat.runtime", "bitformat.cli",
                                                    "bitformat.serve"))}
            assert not bad, f"{m} imports {bad}"
