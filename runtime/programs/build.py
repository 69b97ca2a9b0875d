"""Preparing programs through the kernel cache: HIT (load verified bytes) or compile and publish.

Specs and keys are `runtime.programs.spec`'s (torch-free); this module imports torch only inside
the functions that compile or load, so `dsv4 cache ls` and the launch plan stay torch-free.

    prepared = prepare(spec, cache=KernelCache(kernel_cache_dir()), backend="auto")
    out = prepared.run(*tensors)          # prepared.outcome: hit | compiled | uncached | eager
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.programs.spec import (
    CONFIG_COMPONENTS,
    ProgramSpec,
    build_function,
    default_backend,
    is_native,
    program_key,
)
from runtime.toolchain import toolchain_components
from store.kernel_cache import Hit, KernelCache, Reference

ARTIFACT = "program.pt2"


def reference(device: str = "cpu", keys: dict | None = None) -> Reference:
    """What this environment would build now: the toolchain components (judging every entry's
    toolchain) and, when given, the live keys of a model's programs (from the launch plan)."""
    components = dict(toolchain_components(device, "aoti"))
    return Reference(components=components, keys=dict(keys or {}))


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
    artifact_bytes: int = 0  # the bytes loaded (0: eager, or not loaded)


def prepare(
    spec: ProgramSpec, *, cache: KernelCache | None, backend: str = "auto", device: str = "cpu",
    load: bool = True,
) -> Prepared:
    """HIT (load verified bytes) or compile from the signature, publish, and load.

    Raises UntrustedCacheError (a UserError, one line) when the cache root is not safe to load
    from; every other cache problem is a MISS (the entry quarantined) and a compile.
    """
    started = time.perf_counter()
    backend = default_backend(device) if backend == "auto" else backend
    if backend == "eager":
        return Prepared(spec.name, backend, None, "eager", "eager backend", 0.0, build_function(spec))
    key = program_key(spec, backend, device)
    build = functools.partial(_build, spec, backend, device)
    if cache is None:
        data = _build_bytes(build)
        return Prepared(spec.name, backend, None, "uncached", "no kernel cache", _since(started),
                        _load(spec, backend, data), artifact_bytes=len(data))
    fetched = cache.get_or_build(spec.name, key, build, config_components=CONFIG_COMPONENTS)
    if not load:  # a compile worker: published is done; the parent loads
        return Prepared(spec.name, backend, fetched.hit.fingerprint, _outcome(fetched.built, fetched.hit),
                        fetched.miss.reason if fetched.miss else "", _since(started), None,
                        fetched.miss.kind if fetched.miss else "")
    try:
        run = _load(spec, backend, fetched.hit.data(ARTIFACT))
    except Exception as e:
        if fetched.built:
            raise  # our own fresh artifact does not load: a bug, not a cache problem
        cache.reject(fetched.hit, f"{type(e).__name__}: {e}")
        fetched = cache.get_or_build(spec.name, key, build, config_components=CONFIG_COMPONENTS)
        run = _load(spec, backend, fetched.hit.data(ARTIFACT))
    return Prepared(
        spec.name,
        backend,
        fetched.hit.fingerprint,
        _outcome(fetched.built, fetched.hit),
        fetched.miss.reason if fetched.miss else "",
        _since(started),
        run,
        fetched.miss.kind if fetched.miss else "",
        len(fetched.hit.data(ARTIFACT)),
    )


def load_verified(spec: ProgramSpec, hit: Hit, *, cache: KernelCache, backend: str, device: str = "cpu") -> Prepared:
    """A program from a HIT whose bytes were verified already (the launch plan's probe): loaded
    from those very bytes, the entry never read again, the hit recorded. Bytes that do not load
    get the entry quarantined and the program prepared afresh (`prepare`: a compile)."""
    started = time.perf_counter()
    data = hit.data(ARTIFACT)
    try:
        run = _load(spec, backend, data)
    except Exception as e:
        cache.reject(hit, f"{type(e).__name__}: {e}")
        return prepare(spec, cache=cache, backend=backend, device=device)
    cache.record_hit(hit)
    return Prepared(spec.name, backend, hit.fingerprint, "hit", "", _since(started), run, artifact_bytes=len(data))


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

    program = build_function(spec)

    class Program(torch.nn.Module):
        def forward(self, *args: Any) -> Any:
            return program(*args)

    # forward takes *args: dynamic_shapes has one entry (the args tuple) holding per-input specs.
    return torch.export.export(Program(), example_inputs(spec, device), dynamic_shapes=(per_input,))


def _build(spec: ProgramSpec, backend: str, device: str, out_dir: Path) -> None:
    from runtime.programs.after_ready import COMPILE, loading

    loading(spec.name, COMPILE)  # a ready service in this process counts it
    if is_native(spec):  # compiled from C++ source, not traced
        from runtime.model import native

        native.build(out_dir / ARTIFACT)
        return
    import torch

    from runtime.model.ops import interpreted_trace

    # the export backend runs its graph op by op: trace the formulations made for that
    with interpreted_trace() if backend == "export" else contextlib.nullcontext():
        exported = export_program(spec, device)
    if backend == "export":
        torch.export.save(exported, out_dir / ARTIFACT)
    else:
        torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / ARTIFACT))


def _load(spec: ProgramSpec, backend: str, data: bytes) -> Callable[..., Any]:
    """Load from the verified bytes themselves, never from a path that could change since."""
    import torch

    # importing ops registers `dsv4::matmul` and `dsv4::dense`, which programs compiled for the cpu call
    from runtime.model.ops import use_native
    from runtime.programs.after_ready import loading

    loading(spec.name)  # a ready service in this process counts it

    if is_native(spec):
        from runtime.model import native

        products = native.load(data)
        use_native(products)  # the programs' dense products at few rows run them too (`ops.dense_calls`)
        return functools.partial(build_function(spec), fp4=products)
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
    _remove_extractions_at_exit()
    if loader_class is not None:
        with tempfile.NamedTemporaryFile(prefix="dsv4-program-", suffix=".pt2") as f:
            f.write(data)
            f.flush()
            try:  # (path, model name, run single-threaded, runners, device index: -1 the current)
                return _AotiProgram(loader_class(f.name, "model", False, 1, -1))
            except TypeError:  # another torch's signature (the GPU hosts run their own torch)
                pass
    return torch._inductor.aoti_load_package(io.BytesIO(data))  # the public (slower) loader


# The package loader extracts each package into a directory of its own under the temp dir
# (`aotinductor_XXXXXX`: the shared library it maps, its sources) and removes it when the loaded
# program is destroyed — which a process that ends never does: every `dsv4 serve` stopped left its
# programs' directories behind (small: 17 of them, 44 MB, a stop). So a process that loaded one
# removes, when it ends (atexit: a SIGTERM'd service, and each rank before its `os._exit`, run
# those), the extraction directories of the libraries it still has mapped: its own loads', no one
# else's. Read once, at the end: reading /proc/self/maps costs about a millisecond. A killed
# process still leaves them.
_EXTRACTION = re.compile(r"aotinductor_[A-Za-z0-9]{6}")


@functools.cache
def _remove_extractions_at_exit() -> None:
    atexit.register(_remove_extractions)


def _mapped_extractions() -> set[Path]:
    """The package loader's extraction directories whose files this process has mapped."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing found, nothing removed
        return set()
    found = set()
    for line in (line for line in maps.splitlines() if "aotinductor_" in line):
        parts = line.split(maxsplit=5)
        for parent in Path(parts[-1]).parents if len(parts) == 6 else ():
            if _EXTRACTION.fullmatch(parent.name):
                found.add(parent)
                break
    return found


def _remove_extractions() -> None:
    """Remove the extraction directories of the programs this process still has mapped: at its
    end (their libraries stay mapped until it is gone)."""
    for path in sorted(_mapped_extractions()):
        shutil.rmtree(path, ignore_errors=True)


class _AotiProgram:
    """Calls a loaded package with positional tensors (a program's signature), like
    torch's AOTICompiledModel without its import cost."""

    def __init__(self, loader: Any):
        import torch.utils._pytree as pytree

        self._loader = loader
        self._unflatten = pytree.tree_unflatten
        self._out_spec = spec = pytree.treespec_loads(loader.get_call_spec()[1])
        # a flat tuple of tensors (every program's outputs): built directly, not rebuilt through
        # the tree on every call (some 20 us a call, 13 calls a decode step)
        self._flat = spec.type is tuple and all(child.is_leaf() for child in spec.children())

    def __call__(self, *args: Any) -> Any:
        out = self._loader.boxed_run(list(args))
        return tuple(out) if self._flat else self._unflatten(out, self._out_spec)
