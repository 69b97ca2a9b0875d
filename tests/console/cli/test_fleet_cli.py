"""`dsv4 fleet`: the fleet console's code without the TUI, driven here through fake hosts (the
session `--hosts/--fleet` would make over ssh, made of fakes): what each host is asked to run,
what the command prints in sentences, its JSON, its exit code."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from console_fakes import snapshot

from console.cli import main
from console.data.records import LaunchRecord
from console.fleet.fake import Answer, FakeHost, Ledger
from console.fleet.session import FleetSession
from console.fleet.spec import Fleet, FleetHost
from runtime.launch.spec import LaunchSpec
from store import timeline as T
from store.timeline import TimelineEvent

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
    target = {"kind": "sidecar", "path": "/models/v4/dsv4-packed.r3.safetensors", "reason": "stale: packer",
              "size_bytes": 8}
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
    assert main(["fleet", "logs", "a", "--hosts", "x", "--previous"]) == 0
    assert fleet["hosts"]["a"].commands[-1] == ("service", "log", "--pid", "4242", "--previous")


def test_status_lists_every_host(fleet, capsys):
    fleet["history"] = {"a": [LaunchRecord(launch="a/1/1.0", host="a", pid=9, started=100.0, ended=103.0,
                                           outcome="ok")]}
    assert main(["fleet", "status", "--hosts", "x", "--exclude", "b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in data["hosts"]] == ["a", "b", "c"] and data["left_out"] == ["b"]
    assert [r["pid"] for r in data["hosts"][0]["history"]] == [9]


def test_events_merge_every_hosts_timeline_read_over_its_connection(fleet, capsys):
    def said(*events: TimelineEvent) -> Answer:
        return Answer(lines=tuple(json.dumps(e.to_json()) for e in events))

    fleet["script"] = {
        "a": {("events",): said(TimelineEvent(kind=T.REGISTERING, host="a", ts=100.0, pid=9),
                                TimelineEvent(kind=T.SERVING, host="a", ts=103.0, pid=9, url="http://a:8000"))},
        "b": {("events",): said(*(TimelineEvent(kind=T.FAILED, host="b", ts=t, pid=8, rank=1, text="rank 1 lost")
                                  for t in (101.0, 150.0)))},
        "c": {("events",): Answer(code=255, stderr=("ssh: connect to host c port 22: Connection refused",))}}
    T.append(TimelineEvent(kind=T.UNREACHABLE, host="c", ts=120.0, text="connection refused"))  # the console's own
    assert main(["fleet", "events", "--hosts", "x"]) == 1  # a host whose timeline could not be read
    out = capsys.readouterr()
    assert [line.split(" ", 1)[1] for line in out.out.splitlines()] == [
        "service registering on a (pid 9)", "service serving http://a:8000 on a (pid 9)",
        "c unreachable: connection refused",
        f"service on b failed (rank 1): rank 1 lost (×2 since {time.strftime('%H:%M:%S', time.localtime(101.0))})"]
    assert "c: its timeline could not be read: " in out.err and "Connection refused" in out.err
    assert all(h.commands == [("events", "--json")] for h in fleet["hosts"].values())
    main(["fleet", "events", "--hosts", "x", "--json"])
    assert len(capsys.readouterr().out.splitlines()) == 5  # every event, repeats too


def test_without_hosts_it_is_one_line(capsys):
    assert main(["fleet", "status"]) == 1
    assert capsys.readouterr().err.strip() == "dsv4 fleet: which hosts? give --hosts HOST,… or --fleet FILE"
