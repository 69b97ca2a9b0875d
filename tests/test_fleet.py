"""The fleet console (issue 36): every host of a service in one console, reached with the system
ssh. Hosts are real `sshd` servers, each in its own mount + UTS namespace with its own hostname
and its own files at the same paths, on 127.0.0.2, 127.0.0.3, … (bench/ssh_hosts.py)."""

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

from console.data.collectors import Collectors, console_spec
from console.data.snapshot import SCHEMA_VERSION, Snapshot, SnapshotVersionError
from console.fleet import spec as F
from console.fleet.ssh import Ssh, why
from store.errors import UserError

REPO = Path(__file__).resolve().parents[1]
CONSOLE = [sys.executable, "-m", "console.tui.app"]


def _needs_hosts():
    if why_not := namespaces_work():
        pytest.skip(why_not)


# ---- the fleet as a value ----------------------------------------------------------------------


def test_hosts_are_node_ranks_in_order_with_users_and_ports():
    fleet = F.from_hosts("gpu-a,serve@gpu-b:2222,10.0.0.3")
    assert [(h.name, h.node_rank, h.user, h.port) for h in fleet.hosts] == [
        ("gpu-a", 0, None, None), ("gpu-b", 1, "serve", 2222), ("10.0.0.3", 2, None, None)]
    assert fleet.spec().ranks == 3  # one rank per host unless the launch says otherwise


@pytest.mark.parametrize(("text", "says"), [
    ("a,,b", "an empty host name"), ("a,a", "host a is named twice"), ("-oProxyCommand=x", "not a host name"),
    ("a:99999", "the port must be 1..65535"),
])
def test_bad_hosts_are_one_line(text, says):
    with pytest.raises(UserError, match=says):
        F.from_hosts(text)


@pytest.mark.parametrize(("body", "says"), [
    ("[[hosts]]\nname = 'a'\nflavour = 1\n", "unknown key 'flavour'"),
    ("[[hosts]]\nname = 'a'\nnode_rank = 1\n", r"node ranks must be 0..0, each once \(got \[1\]\)"),
    ("[[hosts]]\nname = 'a'\nport = 0\n", r"hosts\[0\].port: 1..65535"),
    ("[launch]\nbackend = 'fast'\n[[hosts]]\nname = 'a'\n", "refuses"),
    ("[launch]\nflavour = 1\n[[hosts]]\nname = 'a'\n", r"\[launch\] flavour: not a launch setting"),
    ("ssh_options = ['no-equals']\n[[hosts]]\nname = 'a'\n", "KEY=VALUE"),
    ("hosts = 3\n", "no hosts"), ("this is = not toml [", "not TOML"),
])
def test_a_bad_fleet_file_is_one_line_naming_the_file(tmp_path, body, says):
    path = tmp_path / "fleet.toml"
    path.write_text(body)
    with pytest.raises(UserError, match=says) as raised:
        F.load(path)
    assert str(path) in str(raised.value)


def test_a_fleet_file_says_hosts_launch_and_ssh(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text("ssh_options = ['ConnectTimeout=3']\nregistry = 'reg:5000/dsv4'\n"
                    "[launch]\nmodel = '/models/v4'\nbackend = 'export'\nranks = 4\nuse_sidecar = false\n"
                    "[[hosts]]\nname = 'b'\nnode_rank = 1\ndsv4 = '/opt/dsv4/bin/dsv4'\n"
                    "[[hosts]]\nname = 'a'\naddress = '10.0.0.1'\nnode_rank = 0\nssh_options = ['User=serve']\n")
    fleet = F.load(path)
    assert [h.name for h in fleet.hosts] == ["a", "b"]  # by node rank
    assert fleet.hosts[0].destination == "10.0.0.1" and fleet.hosts[1].dsv4 == "/opt/dsv4/bin/dsv4"
    spec = fleet.spec()
    assert (str(spec.model), spec.backend, spec.ranks, spec.use_sidecar) == ("/models/v4", "export", 4, False)
    assert fleet.registry == "reg:5000/dsv4"


def test_ssh_takes_the_operators_options_first_and_shares_connections(tmp_path):
    host = F.FleetHost("a", 0, "10.0.0.1", "serve", 2222, ("ControlMaster=no",), "/opt/dsv4 bin/dsv4")
    argv = Ssh("/cfg", ("ConnectTimeout=2",), tmp_path).argv(host, "snapshot", "--model", "/m x")
    options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert options[:2] == ["ControlMaster=no", "ConnectTimeout=2"]  # ssh keeps the first value it is given
    assert "BatchMode=yes" in options and f"ControlPath={tmp_path}/%C" in options
    assert argv[argv.index("-F") + 1] == "/cfg" and argv[argv.index("-p") + 1] == "2222"
    assert argv[-2:] == ["10.0.0.1", "'/opt/dsv4 bin/dsv4' snapshot --model '/m x'"]  # one shell line, quoted


@pytest.mark.parametrize(("code", "stderr", "says"), [
    (255, ["root@h: Permission denied (publickey)."], "authentication failed"),
    (255, ["ssh: connect to host h port 22: Connection timed out"], "timeout"),
    (255, ["ssh: connect to host h port 22: Connection refused"], "connection refused"),
    (255, ["ssh: Could not resolve hostname h: Name or service not known"], "unknown host"),
    (127, ["sh: 1: dsv4: not found"], "dsv4 missing"),
    (1, ["dsv4 snapshot: something broke"], "dsv4 exited 1: dsv4 snapshot: something broke"),
])
def test_what_an_ssh_failure_means_is_one_line(code, stderr, says):
    assert says in why(F.FleetHost("h", 0), code, stderr)


def test_a_snapshot_round_trips_through_json_and_another_version_is_named(tiny_ckpt_ro):
    snap = Collectors(console_spec(tiny_ckpt_ro, backend="export", max_seq=MAX_SEQ)).snapshot()
    raw = json.loads(json.dumps(snap.to_json(), default=str))
    back = Snapshot.from_json(raw, "gpu-a")
    assert back.host_name == "gpu-a" and back.hostname == snap.hostname
    assert json.loads(json.dumps(back.to_json(), default=str)) == {**raw, "host_name": "gpu-a"}
    assert back.toolchain["torch"] and back.toolchain["dsv4"]
    with pytest.raises(SnapshotVersionError, match=f"v{SCHEMA_VERSION + 1} there \\(a newer dsv4\\), "
                                                   f"v{SCHEMA_VERSION} here"):
        Snapshot.from_json({**raw, "v": SCHEMA_VERSION + 1})


def test_dsv4_snapshot_streams_one_line_per_request_and_ends_with_its_stdin(tiny_ckpt_ro):
    proc = subprocess.Popen([sys.executable, "-m", "console.cli", "snapshot", "--stream", "--model", str(tiny_ckpt_ro)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    first = json.loads(proc.stdout.readline())
    proc.stdin.write(b"\n")
    proc.stdin.flush()
    second = json.loads(proc.stdout.readline())
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert first["v"] == second["v"] == SCHEMA_VERSION and second["ts"] > first["ts"]
    assert "torch" not in first["settings"]  # a snapshot, not a launch


# ---- real hosts over ssh -------------------------------------------------------------------------


def test_once_names_each_hosts_drift_and_why_each_unreachable_one_is(tmp_path, tiny_ckpt_ro):
    """Three hosts (host-c with another torch), one that refuses our key, an address where no
    sshd listens, and a host whose dsv4 is not where the fleet file says."""
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
        text = subprocess.run([*CONSOLE, "--fleet", str(path), "--once"], capture_output=True, text=True,
                              cwd=REPO, timeout=300).stdout
    assert done.returncode == 1, done.stderr  # a host is unreachable: a script sees it
    data = json.loads(done.stdout)
    by = {h["host"]: h for h in data["hosts"]}
    assert [h["host"] for h in data["hosts"]] == ["host-a", "host-b", "host-c", "host-d", "gone", "no-dsv4"]
    for name in ("host-a", "host-b", "host-c"):
        h = by[name]
        assert h["reachable"] and h["error"] == "" and h["hostname"] == name  # its own UTS namespace
        assert {"plan", "services", "device", "programs", "sidecars", "host_stats"} <= set(h)
        assert h["plan"]["model"] == str(hosts[0].mount / "model")
    assert by["host-c"]["toolchain"]["torch"] == "2.12.1+cpu"
    assert data["drift"] == {"host-c": ["torch 2.12.1+cpu here, " + by["host-a"]["toolchain"]["torch"] + " on 2 others"]}
    assert by["host-d"]["reachable"] is False and by["host-d"]["error"].startswith("authentication failed")
    assert by["gone"]["error"] == "connection refused"
    assert by["no-dsv4"]["error"].startswith("dsv4 missing: `/opt/none/dsv4`")
    assert "differs: torch 2.12.1+cpu here" in text and "=== gone (node 4): unreachable — connection refused" in text


def _setup(path: Path, *extra: str):
    from console.tui.args import build_parser, fleet_setup

    return fleet_setup(build_parser().parse_args(["--fleet", str(path), *extra]))


async def _until(pilot, done, what: str, limit: float = 300.0):
    """Pause the app until `done()` (a hang guard, not a bound: nothing here is timed)."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            app = pilot.app
            rows = [{k: v for k, v in r.items() if k not in ("reading", "service")} for r in app.screen_stack[-1].rows()] \
                if hasattr(app.screen_stack[-1], "rows") else []
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
    the hosts it touches."""
    from console.tui.app import Dsv4Console

    _needs_hosts()
    with ssh_hosts(tmp_path, ["host-a", "host-b"], model=tiny_ckpt_ro, trust=True) as (hosts, config):
        shutil.rmtree(hosts[0].root / "programs")
        shutil.copytree(cold_export_launch[0], hosts[0].root / "programs")
        path = fleet_file(tmp_path / "fleet.toml", hosts, config, launch={
            "model": str(hosts[0].mount / "model"), "backend": "export", "max_seq": MAX_SEQ, "ranks": 1})
        setup = _setup(path)
        app = Dsv4Console(setup.spec, fleet=setup, interval=0.5, watch=False, create_default=False)
        try:
            async with app.run_test(size=(200, 50)) as pilot:
                screen = app.screen
                await _until(pilot, lambda: screen.snapshot and all(r.fresh for r in screen.snapshot.hosts), "snapshots")
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
                assert any(line.startswith("warm (read)") for line in lines)
                assert any(line.startswith("warm (compile)") for line in lines)
                await _until(pilot, lambda: all(r.snapshot.sidecars.wanted.verdict == "MAP"
                                                for r in screen.snapshot.hosts), "the next snapshot")
                cells = [screen._cells(r) for r in screen.rows()]
                assert all(c["sidecar"].startswith("MAP") and c["programs"].startswith("HIT") for c in cells), cells

                table.focus()
                table.move_cursor(row=0)
                await pilot.press("enter")  # host-a's own panes, from its snapshots
                await _until(pilot, lambda: app.remote == "host-a" and app.snapshot is not None, "host-a's panes")
                assert app.snapshot.hostname == "host-a" and app.snapshot.sidecars.wanted.verdict == "MAP"
                assert "host-a" in str(app.query_one("#topbar").render())
                await pilot.press("p")  # this view only shows: nothing runs
                assert app.fleet.jobs["host-a"].action == "warm"
                await pilot.press("F")
                assert app.screen is screen
        finally:
            setup.close()
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
    host-b; `s` stops both nodes. Launched again, host-b loses power: its row says why it is
    unreachable and host-a's service fails closed naming rank 1 on host-b."""
    from console.tui.app import Dsv4Console

    _needs_hosts()
    with ssh_hosts(tmp_path, ["host-a", "host-b"], model=tiny_ckpt_ro) as (hosts, config):
        path = fleet_file(tmp_path / "fleet.toml", hosts, config, launch={
            "model": str(hosts[0].mount / "model"), "backend": "eager", "max_seq": MAX_SEQ, "port": 0,
            "rank_timeout": 2.0})
        setup = _setup(path)
        app = Dsv4Console(setup.spec, fleet=setup, interval=0.5, watch=False, create_default=False)
        try:
            async with app.run_test(size=(200, 50)) as pilot:
                screen = app.screen
                await _until(pilot, lambda: screen.snapshot and all(r.fresh for r in screen.snapshot.hosts), "snapshots")
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
                assert rows["host-b"]["state"] in ("connection refused", "connection lost") or \
                    rows["host-b"]["state"].startswith(("connection", "ssh failed")), rows["host-b"]["state"]
                assert "host-b" in rows["host-a"]["state"], rows["host-a"]["state"]
                await asyncio.sleep(0)
        finally:
            setup.close()


# ---- a fleet's rows from snapshots (no hosts needed) ------------------------------------------------


def _reading(name: str, rank: int, *, torch: str = "2.13.0", nodes=(), history=(), reachable=True, error=""):
    import dataclasses

    from console_fakes import snapshot

    from console.fleet.collector import HostReading

    snap = dataclasses.replace(snapshot(), host_name=name, hostname=name, nodes=tuple(nodes), history=tuple(history),
                               toolchain={"dsv4": "0.1.0", "torch": torch, "python": "3.11.7", "device": "cpu: x"})
    return HostReading(name, rank, reachable, error, snap if reachable else None, 0.1, reachable)


def _node(*ranks):
    from console.data.nodes import NodeView

    return NodeView.from_json({"state": "running", "node_rank": 0, "nnodes": 2, "pid": 7, "create_time": 1.0,
                               "master": "127.0.0.2:29500", "model": "/m", "log": "", "events": "", "ranks": list(ranks)})


def test_drift_names_the_component_and_how_many_others_differ():
    from console.fleet.rows import drift

    readings = [_reading("a", 0), _reading("b", 1), _reading("c", 2, torch="2.12.1"), _reading("d", 3)]
    assert drift(readings) == {"c": ("torch 2.12.1 here, 2.13.0 on 3 others",)}
    assert drift(readings[:2]) == {}  # two alike: nothing to say
    split = [_reading("a", 0), _reading("b", 1, torch="2.12.1")]  # one each: both are named
    assert drift(split) == {"a": ("torch 2.13.0 here, 2.12.1 on 1 other",), "b": ("torch 2.12.1 here, 2.13.0 on 1 other",)}


def test_a_registering_host_shows_its_ranks_progress_with_an_eta_and_the_slowest_is_named():
    from console.fleet.collector import FleetSnapshot
    from console.fleet.rows import rows, slowest

    t = 1_800_000_000.0
    fast = _node({"rank": 0, "phase": "kv", "state": "running", "since": t, "ts": t + 1})
    slow = _node({"rank": 1, "phase": "weights", "state": "running", "done": 2, "total": 8, "unit": "layers",
                  "since": t, "ts": t + 10})
    readings = (_reading("a", 0, nodes=[fast]), _reading("b", 1, nodes=[slow]))
    assert slowest(readings) == "slowest: b (weights 2/8)"
    by = {r["host"]: r for r in rows(FleetSnapshot(t, readings))}
    assert by["b"]["phases"] == "r1 weights 2/8 ETA 30s"  # 2 of 8 in 10 s: 30 s left at that rate
    assert by["a"]["phases"].startswith("r0 kv")
    assert slowest(readings[:1]) == ""  # one host: nobody is behind


def test_an_unreachable_host_is_a_row_saying_why_and_nothing_else():
    from console.fleet.collector import FleetSnapshot
    from console.fleet.rows import rows

    [row] = rows(FleetSnapshot(0.0, (_reading("gone", 0, reachable=False, error="connection refused"),)))
    assert (row["reach"], row["state"], row["ok"]) == ("✗", "connection refused", False)
    assert "programs" not in row  # no stale figures beside it


def test_the_fleets_history_is_one_record_per_launch_across_hosts():
    from console.data.records import LaunchRecord, PhaseRecord
    from console.fleet.collector import FleetCollector, FleetSnapshot

    launch = LaunchRecord(launch="a/100/1.00", started=5.0, outcome="ok", phases={"kv": PhaseRecord(seconds=1.0)})
    later = LaunchRecord(launch="a/100/1.00", started=5.0, outcome="killed", error="rank 1 on b lost")
    other = LaunchRecord(launch="b/200/2.00", started=3.0, outcome="ok")
    readings = (_reading("a", 0, history=[launch]), _reading("b", 1, history=[later, other]))

    class Fixed(FleetCollector):
        def __init__(self):  # the merge alone: no streams
            pass

        def snapshot(self, wait=None, what=""):
            return FleetSnapshot(0.0, readings)

    merged = Fixed().history()
    assert [r.launch for r in merged] == ["b/200/2.00", "a/100/1.00"]  # oldest first
    assert merged[1].outcome == "killed" and merged[1].phases == {"kv": PhaseRecord(seconds=1.0)}
    assert merged[0].host == "b"


def _stream_of(program: str):
    """A HostStream whose "ssh" is a local program printing what a hostile host might."""
    from console.fleet.collector import HostStream

    changed = []
    stream = HostStream(F.FleetHost("evil", 0), [sys.executable, "-c", program], lambda: changed.append(1))
    stream.start()
    deadline = time.monotonic() + 60
    while stream.error == "connecting" and time.monotonic() < deadline:
        time.sleep(0.05)
    return stream


@pytest.mark.parametrize(("line", "says"), [
    ("not json at all", "not a snapshot (JSONDecodeError"),
    ('{"v": 5, "toolchain": [1, 2]}', "not a snapshot (ValueError: toolchain"),
    ('{"v": 99}', "another version of the snapshot: v99 there (a newer dsv4)"),
    ('[1, 2, 3]', "not a dsv4 snapshot (no version)"),
])
def test_what_a_hostile_or_foreign_host_sends_is_a_reading_that_says_so(line, says):
    stream = _stream_of(f"import sys; print({line!r}, flush=True); sys.stdin.read()")
    try:
        reading = stream.reading(time.monotonic())
        assert reading.snapshot is None and says in reading.error, reading.error
    finally:
        stream.stop()


def test_a_snapshot_that_parses_but_says_nonsense_is_an_unreadable_row_not_a_crash(tiny_ckpt_ro):
    import dataclasses

    from console.fleet.collector import FleetSnapshot
    from console.fleet.rows import rows

    good = _reading("a", 0)
    bad = dataclasses.replace(good, host="b", snapshot=dataclasses.replace(
        good.snapshot, programs=dataclasses.replace(good.snapshot.programs, entries=(1, 2))))  # not ProgramPlans
    by = {r["host"]: r for r in rows(FleetSnapshot(0.0, (good, bad)))}
    assert by["a"]["reach"] == "✓" and by["b"]["state"].startswith("unreadable snapshot (AttributeError")


@pytest.mark.parametrize(("args", "says"), [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--master-port", "1"], "the node rank must be 0..1"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "a", "--master-port", "0"], "node 0's to resolve"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "auto", "--master-port", "5"], "node 0's to resolve"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "203.0.113.9", "--master-port", "0"],
     "cannot bind a port there"),
])
def test_a_node_that_cannot_start_is_one_line_and_nothing_runs(tiny_ckpt_ro, args, says):
    done = subprocess.run([sys.executable, "-m", "console.cli", "node", "start", str(tiny_ckpt_ro), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    ls = subprocess.run([sys.executable, "-m", "console.cli", "node", "ls", "--json"], capture_output=True,
                        text=True, cwd=REPO, timeout=60)
    assert json.loads(ls.stdout) == []


def test_each_fleet_action_runs_the_dsv4_command_a_person_would():
    from console.fleet import actions as A
    from runtime.launch.spec import LaunchSpec

    spec = LaunchSpec(Path("/models/v4"), backend="export", ranks=2, max_seq=64)
    said = {a: [" ".join(s.remote) for s in A.steps(a, spec, registry="reg:5000/dsv4", insecure=True)]
            for a in ("compile", "prepack", "purge", "pull", "stop")}
    assert said["compile"] == ["compile /models/v4 --backend export --ranks 2 --max-seq 64 --events -"]
    assert said["prepack"] == ["prepack /models/v4 --ranks 2 --events - --force"]
    assert said["pull"] == ["cache pull reg:5000/dsv4 --model /models/v4 --backend export --ranks 2 --max-seq 64 --insecure"]
    assert [s.split(" --")[0] for s in said["purge"]] == ["cache purge", "cache purge", "sidecar purge /models/v4"]
    assert said["stop"] == ["node stop --json"]
    node = A.node_start(spec, 2, 1, "10.0.0.1", 29500).remote
    assert node[:12] == ("node", "start", "--json", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
                         "--master-addr", "10.0.0.1", "--master-port")
