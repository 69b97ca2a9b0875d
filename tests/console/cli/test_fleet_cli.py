"""`dsv4 fleet`: the fleet console's code without the TUI, driven here through fake hosts (the
session `--hosts/--fleet` would make over ssh, made of fakes): what each host is asked to run,
what the command prints in sentences, its JSON, its exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from console_fakes import snapshot

from console.cli import main
from console.data.records import LaunchRecord
from console.fleet.fake import Answer, FakeHost, Ledger
from console.fleet.session import FleetSession
from console.fleet.spec import Fleet, FleetHost
from runtime.launch.spec import LaunchSpec

NODE0 = Answer.record(pid=4321, master="10.0.0.1:29577")


@pytest.fixture
def fleet(monkeypatch):
    """Three fake hosts as `dsv4 fleet` sees them (`--exclude` honoured, as the real flags do)."""
    made: dict = {}
    ledger = Ledger()

    def session_from(args, required=False):
        hosts = [FakeHost(n, i, snapshots=[snapshot()], ledger=ledger, script=made.get("script", {}).get(n),
                          history=made.get("history", {}).get(n, ())) for i, n in enumerate(("a", "b", "c"))]
        f = Fleet(tuple(FleetHost(h.name, h.node_rank) for h in hosts))
        spec = LaunchSpec(Path("/models/v4"), backend="export", ranks=3)
        made["session"] = FleetSession(hosts, spec, fleet=f, left_out=sorted(f.checked_out(args.exclude)))
        made["hosts"] = {h.name: h for h in hosts}
        return made["session"]

    monkeypatch.setattr("console.fleet.flags.session_from", session_from)
    return made


def test_launch_covers_the_hosts_not_left_out_node_0_first(fleet, capsys):
    fleet["script"] = {"a": {("node", "start"): NODE0}}
    assert main(["fleet", "launch", "--hosts", "a,b,c", "--exclude", "c", "--yes"]) == 0
    hosts = fleet["hosts"]
    out = capsys.readouterr().out
    assert hosts["c"].commands == [] and [a[:2] for a in hosts["a"].commands + hosts["b"].commands] == [
        ("node", "start")] * 2
    assert hosts["b"].commands[0][hosts["b"].commands[0].index("--master-port") + 1] == "29577"
    assert "launch started on a, b" in out and "launch done on a, b in " in out and '"master"' not in out


def test_an_action_that_fails_on_a_host_exits_1_and_json_says_each_outcome(fleet, capsys):
    fleet["script"] = {"b": {("compile",): Answer(code=1, stderr=("dsv4 compile: no checkpoint at /models/v4",))}}
    assert main(["fleet", "compile", "a", "b", "--hosts", "x", "--yes", "--json"]) == 1
    said = capsys.readouterr()
    outcomes = json.loads(said.out)
    assert outcomes["a"]["ok"] and not outcomes["b"]["ok"]
    assert outcomes["b"]["outcome"] == "dsv4 exited 1: dsv4 compile: no checkpoint at /models/v4"
    assert "compile failed on b in " in said.err  # the sentences go to stderr beside JSON


def test_purge_lists_each_hosts_files_then_deletes_those(fleet, capsys):
    target = {"kind": "sidecar", "path": "/models/v4/dsv4-packed.r3.safetensors", "reason": "stale: packer", "size_bytes": 8}
    fleet["script"] = {n: (lambda host, args: Answer(lines=(json.dumps([target]),))) for n in "abc"}
    assert main(["fleet", "purge", "--hosts", "x", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"a: 1 to delete\n  sidecar {target['path']}: stale: packer" in out
    assert all(h.commands[-1][-2:] == ("--only", target["path"]) for h in fleet["hosts"].values())


def test_logs_of_a_host_come_over_its_connection(fleet, capsys):
    fleet["script"] = {"a": {("service", "log"): Answer(lines=("registering", "serving http://127.0.0.1:8000"))}}
    assert main(["fleet", "logs", "a", "--hosts", "x"]) == 0
    assert capsys.readouterr().out.splitlines() == ["registering", "serving http://127.0.0.1:8000"]
    assert fleet["hosts"]["a"].commands[-1] == ("service", "log", "--pid", "4242")


def test_status_and_events_list_every_host(fleet, capsys):
    fleet["history"] = {"a": [LaunchRecord(launch="a/1/1.0", host="a", pid=9, started=100.0, ended=103.0, outcome="ok")],
                        "b": [LaunchRecord(launch="b/2/2.0", host="b", pid=8, started=101.0, ended=150.0,
                                           outcome="killed", end="killed by SIGKILL", error="rank 1 lost")]}
    assert main(["fleet", "status", "--hosts", "x", "--exclude", "b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in data["hosts"]] == ["a", "b", "c"] and data["left_out"] == ["b"]
    assert main(["fleet", "events", "--hosts", "x"]) == 0
    said = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert said[:4] == ["service registering on a (pid 9)", "service registering on b (pid 8)",
                        "service serving on a (pid 9)", "service on b failed: killed by SIGKILL: rank 1 lost"]


def test_without_hosts_it_is_one_line(capsys):
    assert main(["fleet", "status"]) == 1
    assert capsys.readouterr().err.strip() == "dsv4 fleet: which hosts? give --hosts HOST,… or --fleet FILE"
