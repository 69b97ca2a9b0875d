"""Program specs and their cache keys, without torch.

A program is a pure torch function of its inputs (activations, cache state, packed weights:
weights are inputs, never constants baked into the artifact) with a declared signature, so it
compiles from the signature alone, before any weight is read. A spec names its function as
"module:qualname" (or holds it, in tests); with `captures`, that function is a *factory* and
the program is `factory(**captures)`. The captures are JSON data and a key component, and the
built program may close over nothing else (`build_function` refuses it otherwise): whatever a
program depends on is in its key.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FunctionType, ModuleType
from typing import Any

from runtime.programs import source_memo
from runtime.programs.source_hash import source_components
from runtime.toolchain import toolchain_components
from store.errors import UserError
from store.fingerprint import Key, canonical_json

BACKENDS = ("aoti", "export", "eager")
# Components that describe a configuration, not the toolchain or source: an entry that differs
# only in these is valid for another deployment (`other-layout`), never `stale`.
CONFIG_COMPONENTS = ("backend", "device", "signature", "layout", "model_dims", "captures")


class CaptureError(UserError):
    """A program closes over a value that is not in its key."""


@dataclass(frozen=True)
class DynamicDim:
    """A named dimension whose size varies at run time within [min, max]."""

    name: str
    min: int
    max: int

    def example(self, index: int) -> int:
        # Distinct example sizes >= 2 so export neither specialises to 0/1 nor unifies dims.
        return min(self.max, max(self.min, 2) + index)


@dataclass(frozen=True)
class TensorSpec:
    """One input: shape entries are ints (static) or the names of dynamic dims."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class ProgramSpec:
    name: str
    fn: Callable[..., Any] | str  # the program (or its factory), or "module:qualname" of it
    inputs: tuple[TensorSpec, ...]
    dims: tuple[DynamicDim, ...] = ()
    layout: Mapping[str, Any] = field(default_factory=dict)  # deployment layout dims (ranks…)
    model_dims: Mapping[str, Any] = field(default_factory=dict)  # model dims the program uses
    captures: Mapping[str, Any] | None = None  # factory arguments (JSON data); None: fn is the program

    def __post_init__(self) -> None:
        declared = {d.name for d in self.dims}
        for t in self.inputs:
            missing = [s for s in t.shape if isinstance(s, str) and s not in declared]
            if missing:
                raise ValueError(f"{self.name}: input {t.name} uses undeclared dims {missing}")
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate input names {names}")
        if self.captures is not None:
            try:
                canonical_json(self.captures)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{self.name}: captures must be JSON data ({e})") from None

    def signature(self) -> dict[str, Any]:
        return {
            "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in self.inputs],
            "dims": {d.name: [d.min, d.max] for d in self.dims},
        }


def default_backend(device: str) -> str:
    return "export" if device == "npu" else "aoti"


def fuses(backend: str) -> bool:
    """Does `backend` compile a program into fused kernels (aoti), not a graph run op by op
    (export, `ops.interpreted_trace`) or no compile at all (eager)?"""
    return backend == "aoti"


def program_key(spec: ProgramSpec, backend: str, device: str = "cpu") -> Key:
    """The full cache key of a program: configuration, source, then toolchain components."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    config: list[tuple[str, Any]] = [
        ("backend", backend),
        ("device", device),
        ("signature", spec.signature()),
        ("layout", dict(spec.layout)),
        ("model_dims", dict(spec.model_dims)),
    ]
    if spec.captures is not None:
        config.append(("captures", dict(spec.captures)))
    native = is_native(spec)  # compiled from its own C++ source by the C++ compiler, whatever the backend
    return Key.of([*config, *_sources(spec.fn), *(_sources(NATIVE_BUILD) if native else ()),
                   *toolchain_components(device, "aoti" if native else backend)])


def _sources(fn: Callable[..., Any] | str) -> list[tuple[str, str]]:
    """A program function's source components; a named one's remembered across processes."""
    return source_memo.source_components(fn) if isinstance(fn, str) else source_components(fn)


# A program whose captures say `native` is built from C++ source (`runtime.model.native`), not
# traced: its spec's function is what runs on the eager tier, and the reference it must equal.
NATIVE_BUILD = "runtime.model.native:build"


def is_native(spec: ProgramSpec) -> bool:
    return bool((spec.captures or {}).get("native"))


def resolve(fn: Callable[..., Any] | str) -> Callable[..., Any]:
    """The function a spec names (imports its module: torch, for the model's programs)."""
    if not isinstance(fn, str):
        return fn
    module_name, _, qualname = fn.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def build_function(spec: ProgramSpec) -> Callable[..., Any]:
    """The program itself: `fn`, or `fn(**captures)`, refused if it closes over a value that
    is not one of its captures (such a value would change the program but not its key)."""
    target = resolve(spec.fn)
    if spec.captures is None:
        program = target
        allowed: set[str] = set()
    else:
        program = target(**spec.captures)
        # the factory's own defaults are written in its (hashed) source: in the key too
        bound = inspect.signature(target).bind(**spec.captures)
        bound.apply_defaults()
        allowed = {canonical_json(v) for v in bound.arguments.values()}
    _check_captures(spec.name, program, allowed, target)
    return program


def _check_captures(name: str, fn: Any, allowed: set[str], factory: Any) -> None:
    if not isinstance(fn, FunctionType):
        return
    cells = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
    defaults = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    for value in cells + defaults:
        if isinstance(value, FunctionType) and _nested_in(value, factory):
            _check_captures(name, value, allowed, factory)
        elif not (_in_key(value, allowed) or (value in defaults and _scalar(value))):
            raise CaptureError(
                f"program {name}: {fn.__qualname__} captures {_short(value)}, which is not in its key; "
                "pass it as a capture (a factory argument) or as an input")


def _scalar(value: Any) -> bool:
    """A default argument written in the source (hashed with it)."""
    return value is None or isinstance(value, bool | int | float | str)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _nested_in(fn: FunctionType, factory: Any) -> bool:
    qualname = getattr(factory, "__qualname__", None)
    return bool(qualname) and fn.__qualname__.startswith(f"{qualname}.<locals>.") and \
        fn.__code__.co_filename == getattr(getattr(factory, "__code__", None), "co_filename", None)


def _in_key(value: Any, allowed: set[str]) -> bool:
    if isinstance(value, ModuleType | type):
        return True  # named code, not data: its source is hashed where the program names it
    try:
        return canonical_json(value) in allowed
    except (TypeError, ValueError):
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "…"
