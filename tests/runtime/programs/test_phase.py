"""Issue 14, the cold path: the parent loads each program the moment the pool publishes it,
while the other programs still compile.

Overlap is pinned by outcome, not by the clock: the `gated` program's compile cannot end before
a gate file exists, and the test opens the gate only once `mlp` is loaded (or staged). Loading
after the whole pool would leave the gate shut and the gated compile fails (TimeoutError).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

GATE_S = 45.0  # how long a gated compile waits before it gives up (only when nothing overlaps)


def _spec(name: str, fn: str = "tests.sample_programs:scaled_mlp", **captures):
    import sample_programs as sp

    from runtime.programs.spec import ProgramSpec

    return ProgramSpec(name, fn, sp.spec().inputs, sp.spec().dims, captures=captures or None)


def _gated(gate):
    return _spec("gated", "tests.sample_programs:waits_for", gate=str(gate), seconds=GATE_S)


def _prepare(tmp_path, specs, events: list, jobs: int = 2, on_event=lambda e: None):
    from runtime.events import Emitter
    from runtime.launch.plan import Plan, judge_programs
    from runtime.launch.spec import LaunchSpec
    from runtime.programs.phase import prepare_programs

    def sink(event):
        events.append(event)
        on_event(event)

    plan = Plan(LaunchSpec(tmp_path, backend="export", device="cpu", jobs=jobs, kernel_cache_dir=tmp_path / "kc"),
                device="cpu", backend="export")
    plan.catalog = SimpleNamespace(specs={s.name: s for s in specs})  # sample programs, not the model's
    plan.programs = judge_programs(plan, keep_verified=True)
    prepared = prepare_programs(plan, Emitter(sink))
    return prepared.runners, prepared.results


def _loaded(event, program: str) -> bool:
    return event.kind == "progress" and (event.detail or {}).get("program") == program


def _said(event, program: str, state: str) -> bool:
    return event.kind == "log" and (event.detail or {}).get("program") == program and event.detail["state"] == state


def _loaders_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("program-load")]


def test_a_published_program_loads_while_another_still_compiles(tmp_path):
    import sample_programs as sp
    import torch

    gate = tmp_path / "gate"
    events: list = []
    specs = [_gated(gate), _spec("mlp")]  # spec order is not the order they publish in
    runners, results = _prepare(tmp_path, specs, events,
                                on_event=lambda e: gate.touch() if _loaded(e, "mlp") else None)
    order = [i for i, e in enumerate(events) if _loaded(e, "mlp") or _said(e, "gated", "published")]
    assert [_loaded(events[i], "mlp") for i in order] == [True, False]  # mlp loaded, then gated published
    assert [r["program"] for r in results] == ["gated", "mlp"]
    assert [(r["outcome"], r["tier"]) for r in results] == [("MISS", "compiled")] * 2
    assert all(r["fingerprint"] and r["seconds"] > 0 for r in results)
    summary = [e.detail for e in events if e.kind == "log" and (e.detail or {}).get("pool")]
    assert len(summary) == 1 and summary[0]["jobs"] == 2
    assert set(summary[0]) >= {"compile_seconds_sum", "longest_s", "wall_s", "peak_host_used", "floor_bytes",
                               "peak_rss"}
    x = sp.inputs()
    for name in ("gated", "mlp"):
        assert torch.allclose(runners[name](*x), sp.scaled_mlp(*x))
    assert _loaders_alive() == []


def test_ready_early_stages_each_program_as_it_publishes(tmp_path):
    import sample_programs as sp

    from runtime.events import Emitter
    from runtime.programs.phase import _compile_in_background
    from runtime.programs.pool import CompilePool
    from runtime.programs.tiers import COMPILED, EAGER, TieredRunners
    from store.kernel_cache import KernelCache

    gate = tmp_path / "gate"
    specs = [_gated(gate), _spec("mlp")]
    table = TieredRunners({s.name: sp.scaled_mlp for s in specs}, {s.name: EAGER for s in specs})
    table.release_compiles(True)  # as registration does once the launch is ready
    events: list = []
    pool = CompilePool(tmp_path / "kc", "export", "cpu", jobs=2)
    background = threading.Thread(target=_compile_in_background, args=(
        pool, specs, KernelCache(tmp_path / "kc"), "export", "cpu", table, Emitter(events.append), "programs"))
    background.start()
    deadline = time.monotonic() + GATE_S
    while table.status() != "compiling 1/2" and time.monotonic() < deadline:
        time.sleep(0.1)
    staged_while_gated_compiles = table.status()
    gate.touch()
    background.join(GATE_S)
    assert staged_while_gated_compiles == "compiling 1/2"
    assert not background.is_alive()
    table.swap_point()
    assert table.tiers == {"gated": COMPILED, "mlp": COMPILED} and not table.failed
    assert not [e for e in events if "stays eager" in (e.message or "")]


def test_a_failed_compile_raises_naming_it_and_stops_the_loader(tmp_path):
    from runtime.programs.phase import CompileFailed

    dying = _spec("dying", "tests.sample_programs:dies", hidden=8)
    with pytest.raises(CompileFailed) as failed:
        _prepare(tmp_path, [_spec("mlp"), dying], [])
    message = str(failed.value)
    assert message.startswith("programs: dying failed to compile (killed by signal 9 (out of memory?))")
    assert "host memory available" in message
    assert _loaders_alive() == []


def test_without_worker_processes_programs_compile_serially_and_still_load(tmp_path, monkeypatch):
    import sample_programs as sp
    import torch

    from runtime.programs.build import prepare
    from runtime.programs.pool import CompilePool
    from store.kernel_cache import KernelCache

    monkeypatch.syspath_prepend(str(REPO))  # compiles in this process import tests.*
    cached = _spec("cached")
    prepare(cached, cache=KernelCache(tmp_path / "kc"), backend="export", load=False)

    def cannot_fork(self, spec):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(CompilePool, "_spawn", cannot_fork)
    events: list = []
    runners, results = _prepare(tmp_path, [_spec("mlp"), cached, _spec("mlp2")], events)
    assert [(r["program"], r["outcome"]) for r in results] == [("mlp", "MISS"), ("cached", "HIT"), ("mlp2", "MISS")]
    assert [e.detail["error"] for e in events if _said(e, "*", "serial")] == \
        ["[Errno 11] Resource temporarily unavailable"]
    x = sp.inputs()
    assert all(torch.allclose(runners[n](*x), sp.scaled_mlp(*x)) for n in ("mlp", "cached", "mlp2"))
    assert _loaders_alive() == []
