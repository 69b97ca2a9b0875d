"""The source components of a program key, read from the project's files without importing them.

A program's key holds `source:<module>.<name>` → the hash of that unit's AST for the program
function and every project function, class or module-level assignment it reaches by name,
transitively, across `import`s. Reading the files (not the live objects) is what lets the
launch plan compute keys in a process that never imports torch. Comments, whitespace and
docstrings do not change a hash; a unit whose source cannot be read is UNKNOWN (a key holding
it never stores). Module globals are hashed as the statement that assigns them, so a constant
a program reads is in its key; a value computed at import time is covered by its expression.

Parsing and walking the files is most of a plan's time (about 0.3 s of a hot `small` launch's
0.4 s check on 2 cores), and the files rarely change: `traced_components` also says what it
read — every file's content digest, every module lookup's answer — so `runtime.programs.source_memo`
can remember a program function's components with it, and a later process reuse them once it has
checked those inputs (a read and a hash a file, a stat a lookup: milliseconds).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store import safeio
from store.fingerprint import UNKNOWN, sha256_hex

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_VENV = PROJECT_ROOT / ".venv"


@dataclass(frozen=True)
class _Module:
    name: str
    defs: dict[str, ast.AST]  # top-level def / class / assigned name → its statement
    imports: dict[str, tuple[str, str | None]]  # local name → (module, attribute or None)
    digest: str  # sha256 of the file's bytes, what a remembered computation is checked by


@dataclass
class Trace:
    """What a computation of components read: each file parsed (path → sha256 of its bytes) and
    each module looked up (name → its file, "" for none). The components are a function of these
    (and of Python's ast, which the memo keys by version)."""

    files: dict[str, str] = field(default_factory=dict)
    lookups: dict[str, str] = field(default_factory=dict)

    def add(self, other: Trace) -> None:
        self.files.update(other.files)
        self.lookups.update(other.lookups)

    def holds(self) -> bool:
        """Is every input as it was? (The files' bytes hashed again; the lookups asked again.)"""
        return (all(_file_digest(path) == digest for path, digest in self.files.items())
                and all(str(module_file(name) or "") == path for name, path in self.lookups.items()))


_recording = threading.local()  # this thread's Traces being recorded, innermost last


@contextlib.contextmanager
def _record(trace: Trace) -> Iterator[Trace]:
    stack = _recording.__dict__.setdefault("stack", [])
    stack.append(trace)
    try:
        yield trace
    finally:
        stack.pop()


def _note(kind: str, key: str, value: str) -> None:
    for trace in getattr(_recording, "stack", ()):
        getattr(trace, kind)[key] = value


def source_components(fn: Callable[..., Any] | str) -> list[tuple[str, str]]:
    """`source:<unit>` → AST hash, for `fn` (a function, or "module:qualname") and every project
    unit it reaches, sorted by unit name."""
    return traced_components(fn)[0]


def traced_components(fn: Callable[..., Any] | str) -> tuple[list[tuple[str, str]], Trace]:
    """`source_components(fn)`, and what computing them read (`runtime.programs.source_memo`
    remembers both)."""
    with _record(Trace()) as trace:
        return _components(fn, trace), trace


def _components(fn: Callable[..., Any] | str, trace: Trace) -> list[tuple[str, str]]:
    root = _root(fn)
    if root is None:
        return [(f"source:{_display(fn)}", UNKNOWN)]
    units: dict[str, str] = {}
    stack = [root]
    while stack:
        module, name, node = stack.pop()
        unit = f"{module.name}.{name}"
        if unit in units:
            continue
        cached = _UNITS.get(id(node))
        if cached is None or cached[0] is not node:
            with _record(Trace()) as read:  # what resolving its names read, for a later root reaching it
                refs = _refs(module, node)
            cached = _UNITS[id(node)] = (node, _hash(node), refs, read)
        trace.add(cached[3])
        units[unit] = cached[1]
        stack.extend(cached[2])
    return [(f"source:{u}", units[u]) for u in sorted(units)]


def _display(fn: Callable[..., Any] | str) -> str:
    if isinstance(fn, str):
        return fn.replace(":", ".")
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _root(fn: Callable[..., Any] | str) -> tuple[_Module, str, ast.AST] | None:
    if isinstance(fn, str):
        module_name, _, qualname = fn.partition(":")
        path = module_file(module_name)
    else:
        module_name, qualname = fn.__module__, fn.__qualname__
        code = getattr(fn, "__code__", None)
        path = Path(code.co_filename) if code is not None else module_file(module_name)
    module = _load(module_name, path) if path else None
    if module is None:
        return None
    node = _find(module, qualname)
    if node is None and not isinstance(fn, str):
        node = _by_line(module, fn)
    return (module, qualname, node) if node is not None else None


def _find(module: _Module, qualname: str) -> ast.AST | None:
    """A top-level unit, or a nested def by its qualname ('f.<locals>.g')."""
    parts = [p for p in qualname.split(".") if p != "<locals>"]
    node = module.defs.get(parts[0])
    for part in parts[1:]:
        node = next((n for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.ClassDef)
                     and n.name == part and n is not node), None) if node is not None else None
    return node


def _by_line(module: _Module, fn: Any) -> ast.AST | None:
    line = getattr(getattr(fn, "__code__", None), "co_firstlineno", None)
    for node in module.defs.values():
        for sub in ast.walk(node):
            if isinstance(sub, ast.FunctionDef | ast.Lambda) and getattr(sub, "lineno", None) == line:
                return sub
    return None


def module_file(name: str) -> Path | None:
    """The .py file of a project module, found without importing anything."""
    found = _module_file(name, name in sys.modules)
    _note("lookups", name, str(found or ""))
    return found


@functools.lru_cache(maxsize=4096)
def _module_file(name: str, _loaded: bool) -> Path | None:
    loaded = sys.modules.get(name)
    if loaded is not None:
        path = getattr(loaded, "__file__", None)
        return Path(path) if path and _in_project(Path(path)) else None
    base = PROJECT_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _in_project(path: Path) -> bool:
    resolved = path.resolve()
    return resolved.is_relative_to(PROJECT_ROOT) and not resolved.is_relative_to(_VENV)


def _load(name: str, path: Path) -> _Module | None:
    try:
        st = os.stat(path)
    except OSError:
        _note("files", str(path), "")
        return None
    module = _parse(name, str(path), st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    _note("files", str(path), module.digest if module is not None else "")
    return module


def _file_digest(path: str) -> str:
    """sha256 of a source file's bytes ("" where it is not a readable regular file)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return _digest_of(path, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=512)
def _digest_of(path: str, _mtime_ns: int, _ctime_ns: int, _size: int, _ino: int) -> str:
    try:
        return hashlib.sha256(safeio.read_regular(path, MAX_SOURCE_BYTES)).hexdigest()
    except OSError:
        return ""


MAX_SOURCE_BYTES = 16 << 20  # a project source file; anything larger is not one


@functools.lru_cache(maxsize=256)
def _parse(name: str, path: str, _mtime_ns: int, _ctime_ns: int, _size: int) -> _Module | None:
    try:
        data = safeio.read_regular(path, MAX_SOURCE_BYTES)
        tree = ast.parse(data.decode("utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    _strip_docstrings(tree)  # once, in place: a unit's hash is then a plain dump of its node
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    defs: dict[str, ast.AST] = {}
    imports: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        defs[n.id] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    imports[a.asname] = (a.name, None)
                else:
                    top = a.name.partition(".")[0]
                    imports[top] = (top, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                imports[a.asname or a.name] = (base, a.name)
    return _Module(name, defs, imports, hashlib.sha256(data).hexdigest())


# id(node) → (node, hash, refs, what resolving the refs read), per process
_UNITS: dict[int, tuple[ast.AST, str, list, Trace]] = {}


def _hash(node: ast.AST) -> str:
    return sha256_hex(ast.dump(node, include_attributes=False))[:16]


def _strip_docstrings(tree: ast.AST) -> None:
    for sub in ast.walk(tree):
        body = getattr(sub, "body", None)
        if (
            isinstance(sub, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            sub.body = body[1:] or [ast.Pass()]


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _refs(module: _Module, node: ast.AST) -> list[tuple[_Module, str, ast.AST]]:
    """The project units `node` names: its own module's globals, and names reached through
    imports (`model.block`, `from runtime.model.dims import Dims`)."""
    found = []
    for sub in _walk_code(node):
        if isinstance(sub, ast.Attribute | ast.Name):
            parts = _dotted(sub)
            if parts:
                hit = _resolve(module, parts, set())
                if hit is not None and hit[2] is not node:
                    found.append(hit)
    return found


def _walk_code(node: ast.AST):
    """ast.walk without annotations: a type named in a signature does not change behaviour."""
    stack = [node]
    while stack:
        sub = stack.pop()
        yield sub
        for name, value in ast.iter_fields(sub):
            if name in ("annotation", "returns"):
                continue
            if isinstance(value, ast.AST):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, ast.AST))


def _resolve(module: _Module, parts: list[str], seen: set[str]) -> tuple[_Module, str, ast.AST] | None:
    head, rest = parts[0], parts[1:]
    if (module.name, head) in seen:
        return None
    seen.add((module.name, head))
    if head in module.defs:
        return module, head, module.defs[head]
    if head not in module.imports:
        return None
    target, attr = module.imports[head]
    if attr is not None:
        sub = module_file(f"{target}.{attr}")
        if sub is None:  # `from m import name`: the name defined (or re-imported) in m
            other = _project_module(target)
            return _resolve(other, [attr, *rest], seen) if other else None
        target = f"{target}.{attr}"
    # a module: walk attributes while they name submodules, then the unit inside
    while rest and module_file(f"{target}.{rest[0]}") is not None:
        target, rest = f"{target}.{rest[0]}", rest[1:]
    other = _project_module(target)
    if other is None or not rest:
        return None
    return _resolve(other, rest, seen)


def _project_module(name: str) -> _Module | None:
    path = module_file(name)
    return _load(name, path) if path is not None else None
