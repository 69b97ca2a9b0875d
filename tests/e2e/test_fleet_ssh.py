"""The fleet over real ssh, end to end (issue 36, then 69): every host a mount + UTS namespace
with its own hostname and files, a real `sshd` on 127.0.0.2, 127.0.0.3, … (bench/ssh_hosts.py),
a real torchrun service across two of them. The orchestration's own tests use fake hosts
(tests/console/fleet); these prove the real thing: ssh, signed imports, launches and logs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import MAX_SEQ
from fleet_hosts import fleet_file, other_torch, ssh_hosts
from hosts import namespaces_work

REPO = Path(__file__).resolve().parents[2]
CONSOLE = [sys.executable, "-m", "console.tui.app"]
pytestmark = pytest.mark.slow


def _needs_hosts():
    if why_not := namespaces_work():
        pytest.skip(why_not)


def test_once_names_each_hosts_drift_and_why_each_unreachable_one_is(tmp_path, tiny_ckpt_ro):
    """Three hosts (host-c with another torch), one that refuses our key, an address where no
    sshd listens, and a host whose dsv4 is not where the fleet file says; `--once` asks each
    twice and carries its launch history, as the one-host `--once` does."""
    _needs_hosts()
    fake = other_torch(tmp_path, "2.12.1+cpu")
    with ssh_hosts(tmp_path, ["host-a", "host-b", "host-c", "host-d"], model=tiny_ckpt_ro, refuse=("host-d",),
                   binds={"host-c": [fake]}) as (hosts, config):
        path = fleet_file(tmp_path / "fleet.toml", hosts, config, launch={"model": str(hosts[0].mount / "model"),
                                                                          "backend": "export", "max_seq": MAX_SEQ},
                          extra_hosts=["[[hosts]]", 'name = "gone"', 'address = "127.0.0.99"', "node_rank = 4", "",
                                       "[[hosts]]", 'name = "no-dsv4"', f'address = "{hosts[0].address}"',
                                       f"port = {hosts[0].port}", 'dsv4 = "/opt/none/dsv4"', "node_rank = 5"])
        done = subprocess.run([*CONSOLE, "--fleet", str(path), "--once", "--json"], capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        text = subprocess.run([sys.executable, "-m", "console.cli", "fleet", "status", "--fleet", str(path)],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 1 and text.returncode == 1, done.stderr  # a host is unreachable: a script sees it
    data = json.loads(done.stdout)
    by = {h["host"]: h for h in data["hosts"]}
    assert [h["host"] for h in data["hosts"]] == ["host-a", "host-b", "host-c", "host-d", "gone", "no-dsv4"]
    for name in ("host-a", "host-b", "host-c"):
        h = by[name]
        assert h["reachable"] and h["error"] == "" and h["hostname"] == name  # its own UTS namespace
        assert {"plan", "services", "device", "programs", "sidecars", "host_stats", "history"} <= set(h)
        assert h["plan"]["model"] == str(hosts[0].mount / "model")
    assert by["host-c"]["toolchain"]["torch"] == "2.12.1+cpu"
    assert data["drift"] == {"host-c": ["torch 2.12.1+cpu here, " + by["host-a"]["toolchain"]["torch"]
                                        + " on 2 others"]}
    assert by["host-d"]["reachable"] is False and by["host-d"]["error"].startswith("authentication failed")
    assert by["gone"]["error"] == "connection refused"
    assert by["no-dsv4"]["error"].startswith("dsv4 missing: `/opt/none/dsv4`")
    out = text.stdout
    assert "differs: torch 2.12.1+cpu here" in out and "=== gone (node 4): unreachable — connection refused" in out


def _session(path: Path, *extra: str):
    from console.fleet.flags import session_from
    from console.tui.args import build_parser

    return session_from(build_parser().parse_args(["--fleet", str(path), *extra]))


async def _until(pilot, done, what: str, limit: float = 300.0):
    """Pause the app until `done()` (a hang guard, not a bound: nothing here is timed)."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            app = pilot.app
            screen = app.screen_stack[-1]
            rows = [{k: v for k, v in r.items() if k != "value"} for r in screen.rows()] \
                if hasattr(screen, "rows") else []
            raise AssertionError(f"still waiting for {what}; fleet log: {app.fleet.log[-12:]}; rows: {rows}")
        await pilot.pause(0.2)


def _jobs_ended(app, action: str, hosts) -> bool:
    jobs = app.fleet.jobs
    return all(h in jobs and jobs[h].action == action and jobs[h].outcome for h in hosts)


@pytest.mark.asyncio
async def test_import_prepack_and_warm_run_on_every_host_with_each_hosts_progress(tmp_path, tiny_ckpt_ro,
                                                                                   cold_export_launch):
    """host-b misses every program host-a holds: `i` brings them, exported on host-a signed by its
    key and imported on host-b (which trusts it) through one pipe. Then `a` marks every host, `p`
    packs a sidecar on each, `w` reads it and compiles (every program a HIT) — each confirmed with
    the hosts it touches. host-a opened from the fleet is the one-host screen, its keys included."""
    from console.tui.app import Dsv4Console
    from console.tui.screens.confirm import ConfirmScreen

    _needs_hosts()
    with ssh_hosts(tmp_path, ["host-a", "host-b"], model=tiny_ckpt_ro, trust=True) as (hosts, config):
        shutil.rmtree(hosts[0].root / "programs")
        shutil.copytree(cold_export_launch[0], hosts[0].root / "programs")
        path = fleet_file(tmp_path / "fleet.toml", hosts, config, launch={
            "model": str(hosts[0].mount / "model"), "backend": "export", "max_seq": MAX_SEQ, "ranks": 1})
        session = _session(path)
        app = Dsv4Console(session.spec, session=session, interval=0.5, watch=False, create_default=False)
        try:
            async with app.run_test(size=(200, 50)) as pilot:
                screen = app.screen
                await _until(pilot, lambda: screen.snapshot and all(r.fresh for r in screen.snapshot.hosts),
                             "snapshots")
                table = screen.query_one("#fleet-table")
                table.move_cursor(row=1)  # host-b (the rows are in node order)
                await pilot.press("i")
                assert "On 1 host: host-b" in str(app.screen.query_one("#dialog-body").render())
                await pilot.press("y")
                await _until(pilot, lambda: _jobs_ended(app, "import", ["host-b"]), "the import")
                assert app.fleet.jobs["host-b"].outcome == "ok", app.fleet.log
                brought = [json.loads(m.read_text()) for m in (hosts[1].root / "programs").rglob("manifest.json")]
                assert brought and {m["origin"]["host"] for m in brought} == {"host-a"}  # host-b's own cache now
                assert {m["origin"]["reference"] for m in brought} == {"stdin"}

                await pilot.press("a", "p")
                dialog = app.screen.query_one("#dialog-body").render()
                assert "On 2 hosts: host-a, host-b" in str(dialog)
                await pilot.press("y")
                await _until(pilot, lambda: _jobs_ended(app, "prepack", ["host-a", "host-b"]), "prepack")
                await pilot.press("w", "y")
                await _until(pilot, lambda: _jobs_ended(app, "warm", ["host-a", "host-b"]), "warm")
                jobs = app.fleet.jobs
                assert [jobs[h].outcome for h in ("host-a", "host-b")] == ["ok", "ok"], app.fleet.log
                lines = [line for _, line in app.fleet.log]
                assert any("warm (read)" in line for line in lines) and any("warm (compile)" in line for line in lines)
                assert any(line.startswith("warm done on host-a, host-b in ") for line in lines)
                assert not any(line.lstrip().startswith(("{", "[")) for line in lines)  # sentences, never records
                await _until(pilot, lambda: all(r.snapshot.sidecars.wanted.verdict == "MAP"
                                                for r in screen.snapshot.hosts), "the next snapshot")
                cells = [screen._cells(r) for r in screen.rows()]
                assert all(c["sidecar"].startswith("MAP") and c["programs"].startswith("HIT") for c in cells), cells

                table.focus()
                await pilot.press("a")  # none marked again
                table.move_cursor(row=0)
                await pilot.press("enter")  # host-a in the one-host panes, its actions included
                await _until(pilot, lambda: app.remote == "host-a" and app.snapshot is not None, "host-a's panes")
                assert app.snapshot.hostname == "host-a" and app.snapshot.sidecars.wanted.verdict == "MAP"
                assert "host-a" in str(app.query_one("#topbar").render())
                await pilot.press("p")  # the one-host prepack, on host-a: it asks before replacing the sidecar
                await _until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "replace question")
                assert "Replace the sidecar?" in app.screen.title_text
                await pilot.press("n")
                await pilot.press("w")  # the one-host warm, run on host-a over its connection
                await _until(pilot, lambda: "warm" in app.jobs and app.jobs["warm"].returncode is not None
                              and app.jobs["warm"].argv[-1].split()[1] == "compile", "host-a's warm")
                assert app.failures == [] and "ssh" in app.jobs["warm"].argv[0]
                await pilot.press("F")
                assert app.screen is screen
        finally:
            session.close()
        for h in hosts:  # each host's own sidecar, on its own disk
            assert any((h.root / "model").glob("dsv4-packed*.safetensors"))


def _complete(url: str) -> list[int]:
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _serving(screen):
    """host-a's service with both ranks serving, or None."""
    for r in screen.snapshot.hosts if screen.snapshot else ():
        if r.host == "host-a" and r.snapshot is not None:
            for v in r.snapshot.services.services:
                if v.state == "serving" and len(v.ranks) == 2:
                    return v
    return None


def _nodes(host) -> list[dict]:
    return [json.loads(p.read_text()) for p in (host.root / "state" / "nodes").glob("*.json")]


@pytest.mark.asyncio
async def test_a_service_launched_across_two_hosts_serves_stops_and_a_lost_host_is_named(tmp_path, tiny_ckpt_ro):
    """`l` starts torchrun on both hosts (node 0's free port as the master); rank 1 runs on
    host-b; `L` on host-a shows its log and rank 1's, read on host-b over its own connection;
    `s` stops both nodes. Launched again, host-b loses power: its row keeps what was last known
    and says why it is unreachable, host-a's service fails closed naming rank 1 on host-b, and the
    fleet log says both in sentences."""
    from console.tui.app import Dsv4Console
    from console.tui.screens.logview import LogScreen

    _needs_hosts()
    with ssh_hosts(tmp_path, ["host-a", "host-b"], model=tiny_ckpt_ro) as (hosts, config):
        path = fleet_file(tmp_path / "fleet.toml", hosts, config, launch={
            "model": str(hosts[0].mount / "model"), "backend": "eager", "max_seq": MAX_SEQ, "port": 0,
            "rank_timeout": 2.0})
        session = _session(path)
        app = Dsv4Console(session.spec, session=session, interval=0.5, watch=False, create_default=False)
        try:
            async with app.run_test(size=(200, 50)) as pilot:
                screen = app.screen
                await _until(pilot, lambda: screen.snapshot and all(r.fresh for r in screen.snapshot.hosts),
                             "snapshots")
                await pilot.press("l")
                assert "On 2 hosts: host-a, host-b" in str(app.screen.query_one("#dialog-body").render())
                await pilot.press("y")
                await _until(pilot, lambda: _serving(screen) is not None, "the service across both hosts")
                service = _serving(screen)
                assert [(r.rank, r.host) for r in service.ranks] == [(0, "host-a"), (1, "host-b")]
                assert len(_complete(service.url)) == 4
                # host-b's own snapshot streams apart from host-a's: its rank reads serve at its next one
                await _until(pilot, lambda: "r1 serve" in {r["host"]: r for r in screen.rows()}["host-b"]["phases"],
                             "host-b's rank 1 serving")
                assert {r["host"]: r for r in screen.rows()}["host-a"]["state"] == "serving"
                said = [line for _, line in app.fleet.log]
                assert any(line.startswith("service serving http") and "on host-a" in line for line in said), said

                screen.query_one("#fleet-table").move_cursor(row=0)
                await pilot.press("enter")  # host-a's panes: L opens its log and rank 1's on host-b
                await _until(pilot, lambda: app.remote == "host-a" and app.snapshot is not None
                             and app.snapshot.services.services, "host-a's services")
                app.query_one("#services-table").focus()
                await pilot.press("L")
                await _until(pilot, lambda: isinstance(app.screen, LogScreen) and app.screen.lines, "host-a's log")
                view = app.screen
                labels = [(f.label, f.host_name) for f in view.feeds]
                assert labels[0] == ("service", "host-a") and ("rank 1 on host-b", "host-b") in labels, labels
                await pilot.press(str(labels.index(("rank 1 on host-b", "host-b"))))
                await _until(pilot, lambda: view.lines, "rank 1's log, read on host-b")
                # rank 1's own log file among host-b's node's service logs (no longer the node's torchrun log)
                assert view.feeds[view.which].where.endswith(".rank1.log"), view.feeds[view.which].where
                await pilot.press("escape", "F")

                await pilot.press("a", "s", "y")
                await _until(pilot, lambda: _jobs_ended(app, "stop", ["host-a", "host-b"]), "the stop")
                assert [app.fleet.jobs[h].outcome for h in ("host-a", "host-b")] == ["ok", "ok"]
                for h in hosts:
                    assert [n["ending"]["how"] for n in _nodes(h)] == ["stopped by SIGTERM"], _nodes(h)

                await pilot.press("a", "l", "y")  # again; then host-b loses power
                await _until(pilot, lambda: _serving(screen) is not None, "the second service")
                hosts[1].kill()

                def lost():
                    rows = {r["host"]: r for r in screen.rows()}
                    return rows["host-b"]["reach"] == "✗" and "rank 1" in str(rows["host-a"].get("state"))

                await _until(pilot, lost, "host-b lost")
                rows = {r["host"]: r for r in screen.rows()}
                assert rows["host-b"]["state"].startswith(("connection", "ssh failed")), rows["host-b"]["state"]
                assert "last known" in rows["host-b"]["state"] and rows["host-b"]["programs"]  # kept, with its age
                assert "host-b" in rows["host-a"]["state"], rows["host-a"]["state"]
                said = [line for _, line in app.fleet.log]
                assert any(line.startswith("host-b unreachable") for line in said), said
                await _until(pilot, lambda: any(line.startswith("service on host-a failed") and "rank 1" in line
                                                for _, line in app.fleet.log), "the failure said")
                await asyncio.sleep(0)
        finally:
            session.close()
