"""Every console action against real `dsv4` worker processes on the tiny preset."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from console.data.collectors import console_spec, default_model_dir
from console.data.launch_state import DONE
from console.tui.app import Dsv4Console
from console.tui.detached import Detached
from console.tui.panes.log import LogPane
from console.tui.screens.confirm import ConfirmScreen
from console.tui.screens.quit import QuitScreen
from runtime.events import PHASES
from store import pagecache, sidecar
from store.fingerprint import Key
from store.kernel_cache import KernelCache
from store.kernel_cache.inventory import inventory

pytestmark = pytest.mark.asyncio
WAIT = 120.0  # an upper bound for a worker on a loaded two-core machine, never a timing assertion


async def until(pilot, condition, what: str) -> None:
    for _ in range(int(WAIT / 0.1)):
        if condition():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def console(model_dir: Path, cache_dir: Path, **kw) -> Dsv4Console:
    spec = console_spec(model_dir, cache_dir, device="cpu", backend="eager", max_seq=64, port=0)
    return Dsv4Console(spec, watch=False, interval=0.5, stop_timeout=20, **kw)


def done(app: Dsv4Console, name: str) -> bool:
    job = app.jobs.get(name)
    return job is not None and job.returncode is not None


async def test_prepack_then_warm_makes_the_sidecar_map_hot(tiny_ckpt, tmp_path):
    app = console(tiny_ckpt, tmp_path / "programs")
    path = sidecar.default_sidecar_path(tiny_ckpt, 1)
    async with app.run_test() as pilot:
        await pilot.press("p")
        await until(pilot, lambda: done(app, "prepack"), "prepack")
        assert app.jobs["prepack"].returncode == 0 and path.is_file()
        assert sidecar.inspect(path).action == sidecar.MAP
        pagecache.evict(path)
        await pilot.press("w")
        await until(pilot, lambda: (done(app, "warm") and app.jobs["warm"].argv[3] == "compile") or app.failures,
                    "warm")
        assert app.failures == []
        await until(pilot, lambda: done(app, "warm"), "compile")
        warmed = time.time()
        app.refresh_now()
        await until(pilot, lambda: app.snapshot and app.snapshot.ts > warmed, "refresh")
        wanted = app.snapshot.sidecars.wanted
        assert wanted.verdict == "MAP" and wanted.next_launch() == "MAP", wanted
        assert wanted.residency >= sidecar.DEFAULT_COLD_THRESHOLD, wanted
        assert app.failures == []


async def test_purge_deletes_only_what_the_plan_calls_stale_or_corrupt_after_listing_each(tiny_ckpt_ro, tmp_path):
    from runtime.launch.plan import program_keys

    cache = KernelCache(tmp_path / "programs")
    spec = console_spec(tiny_ckpt_ro, cache.root, device="cpu", backend="export", max_seq=64, port=0)
    keys = program_keys(spec)
    hit, stale, corrupt = list(keys)[:3]
    cache.publish(hit, keys[hit], {"program.pt2": b"h" * 4096})
    foreign = Key.of([(n, "2.99.0" if n == "torch" else v) for n, v in keys[stale].components])
    cache.publish(stale, foreign, {"program.pt2": b"s" * 4096})  # built by another toolchain
    cache.publish(corrupt, keys[corrupt], {"program.pt2": b"c" * 4096})
    manifest = next(e.path for e in inventory(cache.layout) if e.program == corrupt) / "manifest.json"
    manifest.write_text("{not json")
    app = Dsv4Console(spec, watch=False, interval=0.5, create_default=False)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.snapshot is not None, "first snapshot")
        states = {p.program: p.state for p in app.snapshot.plan.programs}
        assert (states[hit], states[stale], states[corrupt]) == ("HIT", "STALE", "CORRUPT")
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "confirm")
        assert "2 program entries and 0 sidecars" in app.screen.body
        assert "torch is 2.99.0 here" in app.screen.body and "manifest" in app.screen.body  # each file says why
        await pilot.press("n")
        await pilot.pause(0.3)
        assert len(inventory(cache.layout)) == 3
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "confirm")
        await pilot.press("y")
        await until(pilot, lambda: [e.program for e in inventory(cache.layout)] == [hit], "purge")


async def test_the_kernel_cache_view_lists_every_entry_and_x_there_deletes_only_the_unusable(tiny_ckpt_ro, tmp_path):
    """`c`: every entry under the root with its state against this launch (current, another
    layout naming the component, stale naming the change, quarantined); `x` there lists and
    deletes only what can never be used again."""
    from runtime.launch.plan import program_keys
    from runtime.programs.spec import CONFIG_COMPONENTS

    cache = KernelCache(tmp_path / "programs")
    spec = console_spec(tiny_ckpt_ro, cache.root, device="cpu", backend="export", max_seq=64, port=0)
    keys = program_keys(spec)
    other = program_keys(spec.with_(max_seq=128))  # another launch's layout: never purged
    current, layout, stale, broken = list(keys)[:4]
    def publish(program, key, data):  # as a compile publishes: naming its configuration components
        return cache.publish(program, key, {"program.pt2": data}, config_components=CONFIG_COMPONENTS)

    publish(current, keys[current], b"h" * 4096)
    publish(layout, other[layout], b"o" * 4096)
    publish(stale, Key.of([(n, "2.99.0" if n == "torch" else v) for n, v in keys[stale].components]), b"s" * 4096)
    hit = publish(broken, keys[broken], b"b" * 4096)
    cache.reject(hit, "injected: does not load")  # quarantined
    app = Dsv4Console(spec, watch=False, interval=0.5, create_default=False)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.snapshot is not None and app.snapshot.cache.entries, "first snapshot")
        await pilot.press("c")
        table = app.query_one("#cache-table")
        assert table.display and app.focused is table
        rows = {(r["program"], r["state"]): r for r in table.rows_shown}
        assert set(rows) == {(current, "current"), (layout, "other-layout"), (stale, "stale"),
                             (broken, "quarantined")}
        # every why is a sentence naming the component and both values; the raw key difference
        # (each differing component, whole) is kept for the details
        assert "max_seq is 128 here; this launch uses 64" in rows[(layout, "other-layout")]["reason"]
        assert "→" not in rows[(layout, "other-layout")]["reason"]
        torch_now = dict(keys[stale].components)["torch"]
        assert f"torch is 2.99.0 here; this launch uses {torch_now}" in rows[(stale, "stale")]["reason"]
        assert rows[(stale, "stale")]["key difference"] == {"torch": f'"2.99.0" → "{torch_now}"'}
        raw = rows[(layout, "other-layout")]["key difference"]
        assert raw and all(" → " in v for v in raw.values()) and any('"max_seq":128' in v for v in raw.values())
        await pilot.press("x")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "confirm")
        assert "2 program entries and 0 sidecars" in app.screen.body and "torch is 2.99.0 here" in app.screen.body
        await pilot.press("y")
        await until(pilot, lambda: sorted(e.program for e in inventory(cache.layout)) == sorted([current, layout]),
                    "purge")
        await pilot.press("c")
        assert app.query_one("#programs-table").display


async def test_launch_streams_every_phase_survives_the_console_and_a_new_console_stops_it(tiny_ckpt_ro, tmp_path):
    app = console(tiny_ckpt_ro, tmp_path / "programs")
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.press("l")
        await until(pilot, lambda: (app.launch and app.launch.url) or app.failures, "serving")
        assert app.failures == []
        assert [p for p in PHASES if app.launch.phases[p].state != DONE] == []
        assert app.launch.url.startswith("http://127.0.0.1:")
        table = app.query_one("#registration-table")
        assert all("✓" in str(table.get_row_at(i)[0]) for i in range(len(PHASES)))
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, QuitScreen), "quit dialog")
        await pilot.press("l")  # leave it running
    pid, url = app.service.pid, app.launch.url
    try:
        assert app.exit_message().startswith(f"dsv4-console: left the service running: pid {pid} {url}")
        again = console(tiny_ckpt_ro, tmp_path / "programs", create_default=False)
        async with again.run_test(size=(180, 50)) as pilot:
            await until(pilot, lambda: again.service is not None, "re-attached")
            assert again.service.pid == pid
            rows = again.snapshot.services.services
            assert [(r.pid, r.url, r.health, r.from_console) for r in rows] == [(pid, url, "ok", True)]
            found = subprocess.run(["pgrep", "-f", "dsv4 serve"], capture_output=True, text=True).stdout.split()
            assert str(pid) in found  # the service the console launched says what it is
            await pilot.press("s")  # the Services pane has no focus: nothing is stopped
            await pilot.pause(0.3)
            assert not isinstance(again.screen, ConfirmScreen) and psutil.pid_exists(pid)
            again.query_one("#services-table").focus()
            await pilot.press("s")
            await until(pilot, lambda: isinstance(again.screen, ConfirmScreen), "stop question")
            body = again.screen.body
            assert f"pid {pid}" in body and "this console" in body and "requests in flight: 0" in body
            await pilot.press("enter")  # the default is No
            await pilot.pause(0.3)
            assert psutil.pid_exists(pid) and again.service.running
            await pilot.press("s")
            await until(pilot, lambda: isinstance(again.screen, ConfirmScreen), "stop question again")
            await pilot.press("y")
            await until(pilot, lambda: not psutil.pid_exists(pid) or
                        psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "stop")
            await until(pilot, lambda: again.launch.stopped, "stopped shown")
            assert "service stopped" in str(again.query_one("#registration-summary").render())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    from store import services
    from store.history import read_history

    [record] = read_history()  # one record of the launch, with its true end
    assert (record["outcome"], record["pid"], record["end"]) == ("ok", pid, "stopped by SIGTERM")
    assert services.services() == []  # stopped as the operator asked: no row left to dismiss


STAND_IN = ("import time; from store.services import Announcement; a = Announcement('/models/m'); "
            "a.serving('http://127.0.0.1:9'); print('up', flush=True); time.sleep(600)")


def _sleeper(app: Dsv4Console, tmp_path: Path) -> Detached:
    """A stand-in for a service: detached (own session, output to a file), in the registry, held
    by the console as `l` holds the service it starts (by its record)."""
    from store import services

    with open(tmp_path / "svc.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", STAND_IN], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    deadline = time.monotonic() + WAIT
    while (record := services.find(proc.pid)) is None or record.state != services.SERVING:
        assert time.monotonic() < deadline, "the stand-in never announced itself"
        time.sleep(0.05)
    return Detached(record, **app.worker_callbacks())


async def test_quit_with_a_running_service_asks_and_can_stop_it(tiny_ckpt_ro, tmp_path):
    app = console(tiny_ckpt_ro, tmp_path / "programs", create_default=False)
    async with app.run_test() as pilot:
        app.service = _sleeper(app, tmp_path)
        app.run_worker(app.service.run())
        await until(pilot, lambda: app.service.running, "sleeper")
        await app.run_action("quit")  # ctrl+q and the palette's Quit: the same dialog as q
        await until(pilot, lambda: isinstance(app.screen, QuitScreen), "quit dialog")
        await pilot.press("s")  # stopped through the host's `dsv4 service stop`
        await until(pilot, lambda: not app.service.running, "stopped")
    assert app.failures == []  # stopped on request: not a failure


async def test_leave_running_detaches_for_real_and_prints_where_it_is(tiny_ckpt_ro, tmp_path):
    app = console(tiny_ckpt_ro, tmp_path / "programs", create_default=False)
    async with app.run_test() as pilot:
        app.service = _sleeper(app, tmp_path)
        app.run_worker(app.service.run())
        await until(pilot, lambda: app.service.running, "sleeper")
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, QuitScreen), "quit dialog")
        await pilot.press("l")
    pid = app.service.pid
    try:
        await asyncio.sleep(0.5)
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert (tmp_path / "svc.log").read_text().startswith("up")  # its output went to the file
        assert f"pid {pid}" in app.exit_message() and str(tmp_path / "svc.log") in app.exit_message()
    finally:
        os.kill(pid, signal.SIGKILL)


async def test_a_failing_worker_is_reported_and_the_console_keeps_working(tiny_ckpt, tmp_path):
    (tiny_ckpt / "config.json").write_text(json.dumps({"not": "a config"}))
    app = console(tiny_ckpt, tmp_path / "programs")
    async with app.run_test() as pilot:
        await pilot.press("p")
        await until(pilot, lambda: app.failures, "failure")
        failure = app.failures[0]
        assert failure.detail["exit_code"] not in (0, None)
        assert failure.detail["stderr"] and "prepack" in failure.message
        calls = app.snapshot.ts if app.snapshot else 0
        await pilot.press("r")
        await until(pilot, lambda: app.snapshot and app.snapshot.ts > calls, "refresh after failure")


async def test_first_run_creates_the_embedded_default_with_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_DEFAULT_PRESET", "tiny")
    target = default_model_dir()
    app = Dsv4Console(console_spec(kernel_cache=tmp_path / "programs", backend="eager"), watch=False, interval=0.5)
    shown: list[tuple[float | None, float | None, str, str]] = []  # (done, total, job line, Registration's)
    async with app.run_test() as pilot:
        ended: list[object] = []

        # every move of the creation (an action of the runner), and what the panes say then
        def moved(host, job, e) -> None:
            if job.action != "create":
                return
            if job.outcome:
                ended.append(job)
            elif (p := app.jobs_control.progress.get("create")) is not None:
                shown.append((p.done, p.total, str(app.query_one("#sidecars-job Static").render()),
                              str(app.query_one("#registration-summary").render())))

        app.session.runner.listeners.append(moved)  # after the console's own: it has shown the move
        await until(pilot, lambda: "create" in app.jobs, "create started")
        assert "creating the default" in str(app.query_one("#sidecars-job Static").render())
        await until(pilot, lambda: ended, "create")
        await pilot.pause()
        logged = [text for _, _, text in app.query_one(LogPane).lines]
        told = [n.message for n in app._notifications]
        after = str(app.query_one("#registration-summary").render())
    [job] = ended
    assert job.ok, job.outcome
    assert "creating the default" not in after  # once done the pane no longer waits for it (it did until a restart)
    assert (target / sidecar.INDEX_NAME).is_file()
    # real progress: bytes written of the checkpoint's total, then what comes next
    total = json.loads((target / sidecar.INDEX_NAME).read_text())["metadata"]["total_size"]
    counted = [(d, t, job, reg) for d, t, job, reg in shown if d is not None and t]
    assert counted and {t for _, t, _, _ in counted} == {total} and counted[-1][0] == total
    assert all(" / " in job and "MiB" in job and "creating the default" in job for _, _, job, _ in counted)
    assert any(" / " in reg and "then w warms it, l launches" in reg for _, _, _, reg in counted)
    assert "next: w warms the checkpoint (compiles its programs), then l launches" in logged
    assert any(m.startswith("the default checkpoint is ready: w warms it") for m in told)


async def test_a_service_started_from_a_shell_is_seen_and_stopped_after_asking(tiny_ckpt_ro, tmp_path):
    from store import services

    shell = subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(tiny_ckpt_ro), "--port", "0",
                              "--backend", "eager", "--device", "cpu", "--max-seq", "64",
                              "--kernel-cache-dir", str(tmp_path / "programs")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(int(WAIT / 0.2)):
            if any(s.url for s in services.running()) or shell.poll() is not None:
                break
            await asyncio.sleep(0.2)
        [found] = services.running()
        assert found.pid == shell.pid and found.url.startswith("http://127.0.0.1:")
        app = console(tiny_ckpt_ro, tmp_path / "programs", create_default=False)
        async with app.run_test(size=(180, 50)) as pilot:
            await until(pilot, lambda: app.snapshot is not None and app.snapshot.services.services, "services")
            [row] = app.snapshot.services.services
            assert (row.pid, row.url, row.health, row.from_console) == (shell.pid, found.url, "ok", False)
            assert app.service is None  # seen, not adopted: it is not this console's
            app.query_one("#services-table").focus()
            await pilot.press("s")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "stop question")
            assert f"pid {shell.pid}" in app.screen.body and "a shell" in app.screen.body
            await pilot.press("y")
            await until(pilot, lambda: shell.poll() is not None, "stopped")
        assert shell.returncode == 0  # SIGTERM: drained and exited cleanly
    finally:
        if shell.poll() is None:
            shell.kill()
