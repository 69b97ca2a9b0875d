"""The layers, held (issue 70): computed from the import graph of the source (module-level and
function-level imports alike, as `ast` finds them), not stated in prose.

console → bench → runtime → store: a package imports only those to its right; store imports none
of ours. No module imports another that
imports it back. The console never imports torch (a module-level import anywhere in its closure).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("console", "bench", "runtime", "store")  # each may import only those after it


@cache
def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@cache
def imports(module: str) -> tuple[tuple[str, int, bool], ...]:
    """(imported name, line, at module level) for every import statement of `module`."""
    path = modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in tree.body:  # try/except and `if` imports at module level run at import too,
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # but never those only a type checker reads
        if isinstance(node, ast.If | ast.Try):
            top |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if path.name == "__init__.py" else -1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            found.append((base, node.lineno, id(node) in top))
            found += [(f"{base}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return tuple(found)


def ours(name: str) -> str | None:
    """The project module `name` resolves to (a name imported from a module: that module)."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def edges(*, module_level_only: bool = False) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {m: set() for m in modules()}
    for m in modules():
        for name, _line, top in imports(m):
            target = ours(name)
            if target and target != m and not m.startswith(target + ".") and (top or not module_level_only):
                out[m].add(target)
    return out


def test_each_package_imports_only_the_packages_below_it():
    wrong = []
    for m, path in modules().items():
        allowed = PACKAGES[PACKAGES.index(m.split(".")[0]):]
        wrong += [f"{path.relative_to(REPO)}:{line} imports {name}" for name, line, _ in imports(m)
                  if name.split(".")[0] in PACKAGES and name.split(".")[0] not in allowed]
    assert not wrong, "\n".join(wrong)


def test_bench_never_reaches_into_the_console_even_from_a_child_script():
    # a bench that runs console code in a `python -c` child is an import by another name
    pattern = re.compile(r"^\s*(from|import)\s+console\b", re.M)
    wrong = [str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*.py") if pattern.search(p.read_text())]
    assert not wrong


def test_no_module_imports_one_that_imports_it_back():
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components, iterative enough for ours
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("entry", ["console.tui.app", "console.cli", "console.data.collectors"])
def test_the_console_never_imports_torch_at_module_level(entry):
    graph = edges(module_level_only=True)
    seen, todo, chain = {entry}, [entry], {entry: entry}
    while todo:
        m = todo.pop()
        for name, line, top in imports(m):
            if top and name.split(".")[0] == "torch":
                pytest.fail(f"{chain[m]} → imports {name} at {modules()[m].relative_to(REPO)}:{line}")
        for w in graph[m] - seen:
            seen.add(w)
            chain[w] = f"{chain[m]} → {w}"
            todo.append(w)


RUNTIME_ROOMS = ("model", "weights", "programs", "engine", "launch", "serve")  # each imports only those before it


def test_runtime_rooms_import_only_the_rooms_before_them():
    """Inside runtime/: model ← weights ← programs ← engine ← launch ← serve, synth on model; the
    modules at runtime's top (events, contract, log, usage, toolchain, torch_import) are the base
    every room may use, and import no room."""
    wrong = []
    for m, path in modules().items():
        parts = m.split(".")
        if parts[0] != "runtime" or len(parts) < 2:
            continue
        room = parts[1] if len(parts) > 2 or (REPO / "runtime" / parts[1]).is_dir() else None
        below = {None: (), "synth": ("model",)}.get(room, RUNTIME_ROOMS[: RUNTIME_ROOMS.index(room)]
                                                    if room in RUNTIME_ROOMS else None)
        assert below is not None, f"{m}: runtime/{room}/ is not in RUNTIME_ROOMS: place it in the order"
        for name, line, _ in imports(m):
            target = (ours(name) or "").split(".")
            if target[0] == "runtime" and len(target) > 2 and target[1] != room and target[1] not in below:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({room or 'runtime top'}) imports {name}")
    assert not wrong, "\n".join(wrong)
