"""Programs: specs, their cache keys, and preparing them through the program cache.

A program is a pure torch function of its inputs (activations, cache state, packed weights:
weights are inputs, never constants baked into the artifact) with a declared signature, so it
compiles from the signature alone, before any weight is read.

Runtime code calls::

    spec = ProgramSpec("moe.decode", moe_decode, inputs=(...), dims=(...), layout={...})
    prepared = prepare(spec, cache=KernelCache(kernel_cache_dir()), backend="auto")
    out = prepared.run(*tensors)          # prepared.outcome: hit | compiled | uncached | eager

This module imports torch only inside the functions that compile or load, so `dsv4 cache ls`
can compute the current toolchain (`reference()`) without paying for a torch import. Modules
defining the deployment's programs call `register(spec)` at import and are listed in
`PROGRAM_MODULES`; `reference()` computes their live keys so `ls`/`why` can judge entries.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

from store.fingerprint import UNKNOWN, Key, sha256_hex
from store.kernel_cache import Hit, KernelCache, Reference

BACKENDS = ("aoti", "export", "eager")
ARTIFACT = "program.pt2"
# Components that describe a configuration, not the toolchain or source: an entry that differs
# only in these is valid for another deployment (`other-layout`), never `stale`.
CONFIG_COMPONENTS = ("backend", "device", "signature", "layout", "model_dims")
# Modules that define the deployment's programs (they `register` at import).
PROGRAM_MODULES: tuple[str, ...] = ()
# CPU flags that change the code Inductor generates (vector ISA selection).
_CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2",
)  # fmt: skip
# Inductor env knobs that only say where caches live or how much to log: not in the key.
_ENV_IGNORED = re.compile(r"^TORCHINDUCTOR_(CACHE_DIR|FX_GRAPH_CACHE|AUTOGRAD_CACHE|.*LOG.*)$")
_ENV_RELEVANT = re.compile(r"^(TORCHINDUCTOR_|TORCH_COMPILE_|TORCH_CUDA_ARCH_LIST$|CXXFLAGS$)")
PROJECT_ROOT = Path(__file__).resolve().parents[1]

_REGISTRY: dict[str, ProgramSpec] = {}


# ---------------------------------------------------------------------------------------------
# Specs


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
    fn: Callable[..., Any]
    inputs: tuple[TensorSpec, ...]
    dims: tuple[DynamicDim, ...] = ()
    layout: Mapping[str, Any] = field(default_factory=dict)  # deployment layout dims (tp, ranks…)
    model_dims: Mapping[str, Any] = field(default_factory=dict)  # model dims the program uses

    def __post_init__(self) -> None:
        declared = {d.name for d in self.dims}
        for t in self.inputs:
            missing = [s for s in t.shape if isinstance(s, str) and s not in declared]
            if missing:
                raise ValueError(f"{self.name}: input {t.name} uses undeclared dims {missing}")
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate input names {names}")

    def signature(self) -> dict[str, Any]:
        return {
            "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in self.inputs],
            "dims": {d.name: [d.min, d.max] for d in self.dims},
        }


def register(spec: ProgramSpec) -> ProgramSpec:
    _REGISTRY[spec.name] = spec
    return spec


def registered() -> dict[str, ProgramSpec]:
    for module in PROGRAM_MODULES:
        importlib.import_module(module)
    return dict(_REGISTRY)


# ---------------------------------------------------------------------------------------------
# Key components


def default_backend(device: str) -> str:
    return "export" if device == "npu" else "aoti"


def program_key(spec: ProgramSpec, backend: str, device: str = "cpu") -> Key:
    """The full cache key of a program: configuration, source, then toolchain components."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    return Key.of(
        [
            ("backend", backend),
            ("device", device),
            ("signature", spec.signature()),
            ("layout", dict(spec.layout)),
            ("model_dims", dict(spec.model_dims)),
            *source_components(spec.fn),
            *toolchain_components(device, backend),
        ]
    )


def toolchain_components(device: str, backend: str = "aoti") -> list[tuple[str, Any]]:
    """Versions and capabilities that change compiled code; torch-free except for cuda/npu."""
    parts: list[tuple[str, Any]] = [
        ("torch", _torch_version()),
        ("torch.git", _torch_git_version()),
        ("python", platform.python_version()),
        (f"device.{device}", device_capability(device)),
    ]
    if backend == "aoti":
        parts.append(("compiler", compiler_version()))
    parts.append(("env", relevant_env()))
    return parts


def _torch_version() -> str:
    return _torch_version_file().get("__version__", UNKNOWN)


def _torch_git_version() -> str:
    return _torch_version_file().get("git_version", UNKNOWN)


@functools.cache
def _torch_version_file() -> dict[str, str]:
    # torch/version.py read as text (what torch.__version__ comes from): finding the package's
    # spec does not import it, so `dsv4 cache ls` stays torch-free.
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return {}
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return {}
    return dict(re.findall(r"^(\w+)\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.MULTILINE))


def device_capability(device: str) -> Any:
    """CPU ISA flags / CUDA compute capability / NPU SoC name; UNKNOWN if undeterminable."""
    if device == "cpu":
        return {"machine": platform.machine(), "flags": _cpu_flags()}
    try:
        import torch

        if device == "cuda":
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
        if device == "npu":
            import torch_npu  # noqa: F401 - registers torch.npu

            return torch.npu.get_soc_version() if hasattr(torch.npu, "get_soc_version") else UNKNOWN
    except Exception:
        return UNKNOWN
    return UNKNOWN


@functools.cache
def _cpu_flags() -> list[str] | str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return UNKNOWN
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            found.update(line.split(":", 1)[1].split())
    return sorted(found.intersection(_CPU_FLAGS))


@functools.cache
def compiler_version() -> str:
    """First line of `--version` of the C++ compiler Inductor would use (CXX, else g++/clang++)."""
    cxx = os.environ.get("CXX") or next(
        (c for c in ("g++", "clang++", "c++") if shutil.which(c)), None
    )
    if not cxx:
        return UNKNOWN
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    first = out.stdout.strip().splitlines()[:1]
    return first[0] if out.returncode == 0 and first else UNKNOWN


def relevant_env() -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if _ENV_RELEVANT.match(k) and not _ENV_IGNORED.match(k)
    }


# ---------------------------------------------------------------------------------------------
# Canonical source


def source_components(fn: Callable[..., Any]) -> list[tuple[str, str]]:
    """`source:<unit>` → hash of its AST, for fn and every project function, class or module it
    reaches through its globals. Comments, whitespace and docstrings do not change a hash; a
    source that cannot be read is UNKNOWN (the key then never stores)."""
    units: dict[str, str] = {}
    stack: list[Any] = [fn]
    while stack:
        obj = stack.pop()
        unit = _unit_name(obj)
        if unit in units:
            continue
        units[unit] = _canonical_hash(obj)
        if isinstance(obj, FunctionType):
            stack.extend(_project_refs(obj))
    return [(f"source:{u}", units[u]) for u in sorted(units)]


def _unit_name(obj: Any) -> str:
    if isinstance(obj, ModuleType):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


def _canonical_hash(obj: Any) -> str:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return UNKNOWN
    _strip_docstrings(tree)
    return sha256_hex(ast.dump(tree, include_attributes=False))[:16]


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]


def _project_refs(fn: FunctionType) -> list[Any]:
    """Project functions, classes and modules that fn names through its globals."""
    refs = []
    for name in _code_names(fn.__code__):
        obj = fn.__globals__.get(name)
        if isinstance(obj, FunctionType | type | ModuleType) and _in_project(obj):
            refs.append(obj)
    return refs


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):  # nested functions, lambdas, comprehensions
            names |= _code_names(const)
    return names


def _in_project(obj: Any) -> bool:
    module = obj if isinstance(obj, ModuleType) else sys.modules.get(getattr(obj, "__module__", ""))
    path = getattr(module, "__file__", None)
    if not path:
        return False
    resolved = Path(path).resolve()
    return resolved.is_relative_to(PROJECT_ROOT) and not resolved.is_relative_to(PROJECT_ROOT / ".venv")


# ---------------------------------------------------------------------------------------------
# Reference for `cache ls` / `cache why`


def reference(device: str = "cpu", backend: str | None = None) -> Reference:
    """What this environment would build now: toolchain components (every program) and the
    live keys of registered programs. Imports torch only if a program module does."""
    backend = backend or default_backend(device)
    components = dict(toolchain_components(device, "aoti"))
    keys = {name: program_key(spec, backend, device) for name, spec in registered().items()}
    return Reference(components=components, keys=keys)


# ---------------------------------------------------------------------------------------------
# Compiling and loading (torch from here on)


@dataclass(frozen=True)
class Prepared:
    """A program ready to run, and how it got ready (for events and the launch history)."""

    name: str
    backend: str
    fingerprint: str | None
    outcome: str  # hit | compiled | uncached | eager
    reason: str  # why it was not a HIT ("" for a HIT)
    seconds: float
    run: Callable[..., Any] = field(repr=False)
    miss_kind: str = ""  # absent | stale | corrupt | unknown | untrusted ("" for a HIT)


def prepare(
    spec: ProgramSpec, *, cache: KernelCache | None, backend: str = "auto", device: str = "cpu"
) -> Prepared:
    """HIT (load verified bytes) or compile from the signature, publish, and load.

    Raises UntrustedCacheError (a UserError, one line) when the cache root is not safe to load
    from; every other cache problem is a MISS (the entry quarantined) and a compile.
    """
    started = time.perf_counter()
    backend = default_backend(device) if backend == "auto" else backend
    if backend == "eager":
        return Prepared(spec.name, backend, None, "eager", "eager backend", 0.0, spec.fn)
    key = program_key(spec, backend, device)
    build = functools.partial(_build, spec, backend, device)
    if cache is None:
        run = _load(backend, _build_bytes(build))
        return Prepared(spec.name, backend, None, "uncached", "no program cache", _since(started), run)
    fetched = cache.get_or_build(spec.name, key, build, config_components=CONFIG_COMPONENTS)
    try:
        run = _load(backend, fetched.hit.data(ARTIFACT))
    except Exception as e:
        if fetched.built:
            raise  # our own fresh artifact does not load: a bug, not a cache problem
        cache.reject(fetched.hit, f"{type(e).__name__}: {e}")
        fetched = cache.get_or_build(spec.name, key, build, config_components=CONFIG_COMPONENTS)
        run = _load(backend, fetched.hit.data(ARTIFACT))
    return Prepared(
        spec.name,
        backend,
        fetched.hit.fingerprint,
        _outcome(fetched.built, fetched.hit),
        fetched.miss.reason if fetched.miss else "",
        _since(started),
        run,
        fetched.miss.kind if fetched.miss else "",
    )


def _outcome(built: bool, hit: Hit) -> str:
    if not built:
        return "hit"
    return "compiled" if hit.path is not None else "uncached"


def _since(started: float) -> float:
    return time.perf_counter() - started


def _build_bytes(build: Callable[[Path], None]) -> bytes:
    with tempfile.TemporaryDirectory(prefix="dsv4-program-") as tmp:
        build(Path(tmp))
        return (Path(tmp) / ARTIFACT).read_bytes()


def example_inputs(spec: ProgramSpec, device: str = "cpu") -> tuple[Any, ...]:
    """Uninitialised tensors of the signature (dynamic dims at distinct example sizes)."""
    import torch

    sizes = {d.name: d.example(i) for i, d in enumerate(spec.dims)}
    return tuple(
        torch.empty(
            [sizes[s] if isinstance(s, str) else s for s in t.shape],
            dtype=getattr(torch, t.dtype),
            device=device,
        )
        for t in spec.inputs
    )


def export_program(spec: ProgramSpec, device: str = "cpu") -> Any:
    """torch.export of the spec's function with its dynamic dims (no weight is read)."""
    import torch

    dims = {d.name: torch.export.Dim(d.name, min=d.min, max=d.max) for d in spec.dims}
    per_input = tuple(
        {i: dims[s] for i, s in enumerate(t.shape) if isinstance(s, str)} or None for t in spec.inputs
    )

    class Program(torch.nn.Module):
        def forward(self, *args: Any) -> Any:
            return spec.fn(*args)

    # forward takes *args: dynamic_shapes has one entry (the args tuple) holding per-input specs.
    return torch.export.export(Program(), example_inputs(spec, device), dynamic_shapes=(per_input,))


def _build(spec: ProgramSpec, backend: str, device: str, out_dir: Path) -> None:
    import torch

    exported = export_program(spec, device)
    if backend == "export":
        torch.export.save(exported, out_dir / ARTIFACT)
    else:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / ARTIFACT))


def _load(backend: str, data: bytes) -> Callable[..., Any]:
    """Load from the verified bytes themselves, never from a path that could change since."""
    import torch

    if backend == "export":
        return torch.export.load(io.BytesIO(data)).module()
    return _load_aoti(data)


def _load_aoti(data: bytes) -> Callable[..., Any]:
    """Load an AOTInductor package from verified bytes.

    The public `aoti_load_package` imports torch._inductor and dynamo (seconds) just to load a
    shared library; the package loader it wraps needs neither, so a HIT costs milliseconds.
    The bytes go to a private (0600) temp file that only lives while the loader extracts and
    dlopens it. Residual risk: a process running as this user could swap that file in between;
    such a process can already run code as us.
    """
    import torch

    loader_class = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_class is None:  # another torch build: fall back to the public (slower) loader
        return torch._inductor.aoti_load_package(io.BytesIO(data))
    with tempfile.NamedTemporaryFile(prefix="dsv4-program-", suffix=".pt2") as f:
        f.write(data)
        f.flush()
        loader = loader_class(f.name, "model", False, 1, -1)
    return _AotiProgram(loader)


class _AotiProgram:
    """Calls a loaded package with positional tensors (a program's signature), like
    torch's AOTICompiledModel without its import cost."""

    def __init__(self, loader: Any):
        import torch.utils._pytree as pytree

        self._loader = loader
        self._unflatten = pytree.tree_unflatten
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args: Any) -> Any:
        return self._unflatten(self._loader.boxed_run(list(args)), self._out_spec)
