"""Issue 14: missing programs compile in a pool of worker processes; serving can start eager."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import sample_programs as sp
import torch
from conftest import MAX_SEQ, REPO, launch

from console.cli import main as cli
from runtime.launch.plan import model_programs
from runtime.launch.spec import LaunchSpec
from runtime.programs.build import prepare
from runtime.programs.calls import engine_runners
from runtime.programs.pool import CompilePool, compile_order
from runtime.programs.spec import ProgramSpec, build_function
from runtime.programs.tiers import COMPILED, EAGER, TieredRunners
from store.kernel_cache import KernelCache
from store.kernel_cache.inventory import inventory
from store.kernel_cache.read import manifests

pytestmark = pytest.mark.slow


def _specs(model_dir, *names):
    programs = model_programs(LaunchSpec(model_dir, max_seq=MAX_SEQ))
    return [programs.specs[n] for n in names]


def _entries(root) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in inventory(KernelCache(root).layout):
        counts[e.program] = counts.get(e.program, 0) + 1
    return counts


def test_two_pools_on_one_cache_compile_each_key_once(tiny_ckpt_ro, tmp_path):
    specs = _specs(tiny_ckpt_ro, "embed.decode", "head.decode", "embed.prefill")
    results = []

    def run():
        results.append(CompilePool(tmp_path / "kc", "export", "cpu", jobs=2).run_or_serial(specs))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _entries(tmp_path / "kc") == {s.name: 1 for s in specs}
    for s in specs:
        outcomes = sorted(r[s.name].outcome for r in results)
        assert all(r[s.name].ok for r in results)
        assert outcomes in (["compiled", "hit"], ["compiled", "compiled"]) and outcomes.count("compiled") == 1
    manifest = next(manifests(KernelCache(tmp_path / "kc").layout, "embed.decode"))
    assert manifest.compile_peak_rss > 50 << 20  # the worker's own peak, a torch process


def test_stopping_a_pool_kills_its_workers_and_leaves_no_staging(tmp_path):
    slow = ProgramSpec("slow", "tests.sample_programs:sleeps", sp.spec().inputs, sp.spec().dims,
                       captures={"seconds": 60.0})
    stop = threading.Event()
    compiling, states = threading.Event(), []

    def on_event(program, state, detail):
        states.append(state)
        if state == "compiling":
            compiling.set()

    pool = CompilePool(tmp_path / "kc", "export", "cpu", jobs=1, stop=stop, on_event=on_event)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    raised = []

    def run():
        try:
            pool.run_or_serial([slow])
        except InterruptedError as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert compiling.wait(30)
    time.sleep(1.0)
    stopped = time.monotonic()
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and raised
    assert "serial" not in states  # a cancel is not a pool that cannot start: nothing compiles in-process
    assert time.monotonic() - stopped < 5  # generous on a loaded host; the pool's grace is 1 s
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before
    base = tmp_path / "kc" / "v1" / "slow"
    assert not base.exists() or not [p for p in base.iterdir() if p.name.startswith(".")]


def test_the_native_programs_compile_first_then_the_longest():
    """A cold launch's eager tier runs its products natively from the moment `experts.native` is in:
    it goes first, whatever the seconds last recorded; the rest longest first (the pool's wall)."""
    from dataclasses import replace

    base = sp.spec()
    specs = [replace(base, name="short"), replace(base, name="long"),
             replace(base, name="experts.native", captures={"native": True}), replace(base, name="never")]
    history = {"short": (5.0, 0), "long": (90.0, 0), "experts.native": (1.2, 0)}
    assert [s.name for s in compile_order(specs, history)] == ["experts.native", "long", "short", "never"]


def test_a_killed_worker_fails_its_program_naming_the_signal(tmp_path):
    dying = ProgramSpec("dying", "tests.sample_programs:dies", sp.spec().inputs, sp.spec().dims, captures={"hidden": 8})
    result = CompilePool(tmp_path / "kc", "export", "cpu", jobs=1).run_or_serial([dying])["dying"]
    assert not result.ok and "killed by signal 9 (out of memory?)" in result.error


def test_a_worker_that_says_more_than_a_pipe_holds_still_publishes(tmp_path):
    import threading

    noisy = ProgramSpec("noisy", "tests.sample_programs:noisy", sp.spec().inputs, sp.spec().dims,
                        captures={"hidden": 8})
    stop, results = threading.Event(), {}
    pool = CompilePool(tmp_path / "kc", "export", "cpu", jobs=1, stop=stop)
    t = threading.Thread(target=lambda: results.update(pool.run([noisy])))
    t.start()
    t.join(600)  # a hang guard, not a speed bound: a worker blocked on a full pipe never exits
    if t.is_alive():
        stop.set()
        t.join()
    assert "noisy" in results, "the pool never saw its worker exit"
    assert results["noisy"].ok and results["noisy"].outcome == "compiled", results


def test_jobs_zero_is_one_line(tiny_ckpt_ro, capsys):
    assert cli(["compile", str(tiny_ckpt_ro), "--jobs", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--jobs 0 is out of range" in err


@pytest.mark.heavy  # many cold compiles: `pytest -m heavy`
def test_tokens_do_not_depend_on_the_tier_even_across_a_swap_mid_generation(tiny_ckpt_ro, tmp_path):
    compiled, _ = launch(tiny_ckpt_ro, cache_dir=tmp_path / "kc", max_slots=1)
    expected = compiled.validation_tokens
    engine = compiled.engine
    prompt = [5, 6, 7, 8]
    engine.reset()
    want = list(engine.generate(prompt, 6))
    # the same engine on a table that starts eager and swaps the compiled programs in after 2 steps
    compiled_runners = dict(compiled.tiers)
    specs = compiled.programs.specs
    table = TieredRunners({n: build_function(s) for n, s in specs.items()}, dict.fromkeys(specs, EAGER))
    engine.runners = engine_runners(compiled.programs, table)
    engine.reset()
    got = []
    for i, token in enumerate(engine.generate(prompt, 6)):
        got.append(token)
        if i == 1:
            for name, runner in compiled_runners.items():
                table.stage(name, runner)
    assert got == want and set(table.tiers.values()) == {COMPILED}
    assert table.steps[EAGER] >= 2 and table.steps[COMPILED] >= 3
    compiled.close()

    early, events = launch(tiny_ckpt_ro, cache_dir=tmp_path / "kc-early", ready="early", max_slots=1)
    assert early.validation_tokens == expected  # served eager, same tokens
    assert set(early.phases["programs"]["tiers"].values()) == {EAGER}
    deadline = time.monotonic() + 600
    while early.tiers.status() != COMPILED and time.monotonic() < deadline:
        time.sleep(0.5)
    early.engine.reset()
    assert list(early.engine.generate(prompt, 6)) == want
    assert early.tiers.status() == COMPILED
    swaps = [e for e in events if e.kind == "log" and (e.detail or {}).get("tier") == COMPILED]
    assert len(swaps) == len(specs)
    # after ready, the tier swaps are the only compiling, each program's once and named so (issue 72)
    assert early.after_ready.counts == {(name, "tier-swap"): 1 for name in specs}
    # the compiles waited for the launch to be ready: they never competed with its phases
    validated = next(i for i, e in enumerate(events) if e.phase == "validate" and e.kind == "end")
    queued = next(i for i, e in enumerate(events) if (e.detail or {}).get("state") == "queued")
    assert validated < queued
    early.close()


def test_a_failed_compile_stays_eager_with_one_warning(tmp_path):
    from runtime.events import Emitter
    from runtime.programs.phase import _compile_in_background

    dying = ProgramSpec("dying", "tests.sample_programs:dies", sp.spec().inputs, sp.spec().dims, captures={"hidden": 8})
    fine = ProgramSpec("mlp", "tests.sample_programs:scaled_mlp", sp.spec().inputs, sp.spec().dims)
    table = TieredRunners({"dying": sp.scaled_mlp, "mlp": sp.scaled_mlp}, {"dying": EAGER, "mlp": EAGER})
    table.release_compiles(True)  # as registration does once the launch is ready
    events = []
    pool = CompilePool(tmp_path / "kc", "export", "cpu", jobs=1)
    cache = KernelCache(tmp_path / "kc")
    _compile_in_background(pool, [dying, fine], cache, "export", "cpu", table, Emitter(events.append), "programs")
    table.swap_point()
    assert table.tiers == {"dying": EAGER, "mlp": COMPILED}
    warnings = [e for e in events if e.kind == "log" and "stays eager" in (e.message or "")]
    assert len(warnings) == 1 and "dying" in warnings[0].message
    assert table.status().startswith("eager 1/2")
    x = sp.inputs()
    assert torch.allclose(table["mlp"](*x), sp.scaled_mlp(*x))
    assert prepare(fine, cache=cache, backend="export").outcome == "hit"


def test_sigterm_during_registration_stops_the_compiles_and_records_it(tiny_ckpt_ro, tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    cache = tmp_path / "kc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "console.cli", "serve", str(tiny_ckpt_ro), "--backend", "export", "--port", "0",
         "--kernel-cache-dir", str(cache), "--events", "-", "--max-seq", str(MAX_SEQ), "--jobs", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    workers = []
    for line in proc.stdout:
        event = json.loads(line)
        if (event.get("detail") or {}).get("state") == "compiling":
            workers.append(event["detail"]["pid"])
            if len(workers) == 2:
                break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) != 0
    for pid in workers:  # the workers are gone (killed, not left to finish their compiles)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    record = json.loads((Path(os.environ["DSV4_STATE_DIR"]) / "launches.jsonl").read_text().splitlines()[-1])
    # programs and weights run side by side: the interrupt stops both, the first to end is named
    assert (record["outcome"], record["error"]) == ("error", "interrupted")
    assert record["failed_phase"] in ("programs", "weights")
    assert record["phases"]["programs"]["error"] == "interrupted"
    from store.atomic import STAGING_PREFIX

    assert [p for p in cache.rglob(f"{STAGING_PREFIX}*")] == []
