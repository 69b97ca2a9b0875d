"""The orchestration of actions across hosts, driven through fake hosts (console.fleet.fake): no
root, no sshd, no second machine. What each host was asked to run, in what order, and what it
was given, are the outcomes here (the fakes record them as a real host would receive them)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from console_fakes import snapshot

from console.data.nodes import NodeView
from console.fleet.fake import Answer, FakeHost, Ledger
from console.fleet.session import FleetSession
from console.fleet.spec import Fleet, FleetHost
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from store.nodes import Node

SPEC = LaunchSpec(Path("/models/v4"), backend="export", device="cpu", max_seq=64)
NODE0 = Answer.record(pid=4321, master="10.0.0.1:29577", node_rank=0, nnodes=3)


def _session(names, script=None, snaps=None, **kw) -> tuple[FleetSession, dict[str, FakeHost], Ledger]:
    ledger = Ledger()
    hosts = {n: FakeHost(n, i, snapshots=[(snaps or {}).get(n, snapshot())], script=(script or {}).get(n),
                         ledger=ledger)
             for i, n in enumerate(names)}
    fleet = Fleet(tuple(FleetHost(n, i) for i, n in enumerate(names)))
    session = FleetSession(list(hosts.values()), SPEC.with_(ranks=len(names)), fleet=fleet, **kw)
    session.collector.snapshot()
    return session, hosts, ledger


def _arg(args: tuple[str, ...], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_a_launch_starts_node_0_first_and_relays_the_port_it_picked():
    session, hosts, ledger = _session(["a", "b", "c"], {"a": {("node", "start"): NODE0}})
    jobs = asyncio.run(session.runner.run("launch", session.active()))
    assert {h: j.outcome for h, j in jobs.items()} == {"a": "ok", "b": "ok", "c": "ok"}
    [first] = hosts["a"].commands
    assert (_arg(first, "--node-rank"), _arg(first, "--master-port"), _arg(first, "--master-addr")) == \
        ("0", "0", "auto")
    for rank, name in ((1, "b"), (2, "c")):
        [args] = hosts[name].commands
        assert (_arg(args, "--node-rank"), _arg(args, "--master-addr"), _arg(args, "--master-port")) == (
            str(rank), "10.0.0.1", "29577")  # node 0's own port and address, relayed
        assert _arg(args, "--nnodes") == "3" and _arg(args, "--nproc-per-node") == "1"
    starts, ends = ledger.order("start"), ledger.order("end")
    assert starts[0] == "a" and ends[0] == "a" and set(starts[1:]) == {"b", "c"}  # node 0 ended before any other began
    said = session.log.sentences()
    launch = [s for s in said if s.startswith("launch ")]
    assert launch[0] == "launch started on a, b, c" and launch[-1].startswith("launch done on a, b, c in ")
    assert not any(s.lstrip().startswith("{") or '"master"' in s for s in said)  # never a raw record
    assert any("node 0 up: torchrun pid 4321, master 10.0.0.1:29577" in s for s in said)


def test_when_node_0_fails_no_other_node_starts_and_each_says_why():
    failing = {("node", "start"): Answer(code=1, stderr=("dsv4 node start: the node did not start: port in use",))}
    session, hosts, _ = _session(["a", "b"], {"a": failing})
    jobs = asyncio.run(session.runner.run("launch", session.active()))
    assert "port in use" in jobs["a"].outcome and jobs["b"].outcome == "not started: node 0 (a) failed"
    assert hosts["b"].commands == []
    assert session.log.sentences()[-1].startswith("launch failed on a, b in ")


def _serving_node(rank: int) -> NodeView:
    return NodeView(node=Node(pid=700 + rank, create_time=1.0, node_rank=rank, nnodes=2, master="10.0.0.1:29577",
                              model="/models/v4", log="/state/nodes/n.log", events=""), state="running")


def test_a_stop_asks_the_host_of_node_0_first_then_the_others():
    """Node 0 is the host whose running node record says so (here the second host: a relaunch
    after the first was left out), not the first in the list."""
    snaps = {"a": dataclasses.replace(snapshot(), nodes=(_serving_node(1),)),
             "b": dataclasses.replace(snapshot(), nodes=(_serving_node(0),)), "c": snapshot()}
    session, hosts, ledger = _session(["a", "b", "c"], snaps=snaps)
    jobs = asyncio.run(session.runner.run("stop", ["a", "b", "c"]))
    assert all(j.ok for j in jobs.values())
    assert ledger.order("end")[0] == "b" and ledger.order("start")[0] == "b"
    assert ledger.entries.index(next(e for e in ledger.entries if e[1] == "end" and e[2] == "b")) < \
        min(i for i, e in enumerate(ledger.entries) if e[1] == "start" and e[2] != "b")
    assert all(h.commands == [("node", "stop", "--json")] for h in hosts.values())


def _holding(*held: tuple[str, str], missing: bool = False):
    """A snapshot whose plan HITs `held` (program, fingerprint) — or misses them."""
    state = Outcome.MISS if missing else Outcome.HIT
    entries = tuple(dataclasses.replace(snapshot().programs.entries[0], program=p, fingerprint=fp, state=state)
                    for p, fp in held)
    snap = snapshot()
    return dataclasses.replace(snap, programs=dataclasses.replace(snap.programs, entries=entries))


def test_an_import_comes_from_the_host_holding_most_of_what_is_missing_under_the_same_keys():
    wanted = [("embed", "e" * 64), ("head", "h" * 64), ("layer.0", "l" * 64)]
    snaps = {"target": _holding(*wanted, missing=True),
             "near": _holding(*wanted[:2]),  # two of them, the very keys
             "other": _holding(*[(p, "0" * 64) for p, _ in wanted])}  # all three, another toolchain's keys
    script = {"near": {("cache", "export"): Answer(stdout=b"signed bundle bytes")},
              "target": {("cache", "import"): Answer(lines=("imported 2 entries from near",))}}
    session, hosts, _ = _session(["target", "near", "other"], script, snaps)
    jobs = asyncio.run(session.runner.run("import", ["target"]))
    assert jobs["target"].ok, jobs["target"].outcome
    assert [a[:3] for a in hosts["near"].commands] == [("cache", "export", "-o")] and hosts["other"].commands == []
    [into] = hosts["target"].commands
    assert into[:3] == ("cache", "import", "-") and hosts["target"].received[into] == b"signed bundle bytes"
    assert any("from near: 2 programs (embed, head)" in s for s in session.log.sentences())


def test_an_import_with_no_host_holding_the_keys_says_so_and_runs_nothing():
    snaps = {"target": _holding(("embed", "e" * 64), missing=True), "other": _holding(("embed", "0" * 64))}
    session, hosts, _ = _session(["target", "other"], snaps=snaps)
    jobs = asyncio.run(session.runner.run("import", ["target"]))
    assert jobs["target"].outcome == "no other host holds what it misses under the same keys"
    assert hosts["other"].commands == [] and hosts["target"].commands == []


def test_a_host_left_out_takes_its_ranks_and_the_launch_covers_the_others():
    session, hosts, _ = _session(["a", "b", "c"], {"a": {("node", "start"): NODE0}})
    hosts["c"].go_away("connection refused")
    session.collector.snapshot()
    assert session.launch_problem() == ("c cannot be reached (connection refused); "
                                        "leave it out (-) to launch on the others")
    session.leave_out("c")
    assert session.spec.ranks == 2 and session.active() == ["a", "b"] and session.launch_problem() == ""
    assert hosts["a"].watched[-1] == (SPEC.with_(ranks=2), 1)  # each host plans the KV of its own rank
    asyncio.run(session.runner.run("launch", session.active()))
    assert hosts["c"].commands == [] and {_arg(hosts[h].commands[0], "--nnodes") for h in "ab"} == {"2"}
    assert "c left out: ranks, plans and launches cover the others" in session.log.sentences()
    session.bring_back("c")
    assert session.spec.ranks == 3 and hosts["c"].watched[-1] == (SPEC.with_(ranks=3), 1)


def test_a_purge_lists_each_hosts_targets_then_deletes_only_those_confirmed():
    targets = [{"kind": "program", "path": "/cache/v1/head/c3", "reason": "corrupt: sha256", "size_bytes": 10},
               {"kind": "sidecar", "path": "/models/v4/dsv4-packed.r2.safetensors", "reason": "stale",
                "size_bytes": 20}]

    def answer(host, args):
        if "--dry-run" in args:
            return Answer(lines=(json.dumps(targets),))
        return Answer(lines=(json.dumps([t for t in targets if t["path"] in args]),))

    session, hosts, _ = _session(["a", "b"], {"a": answer, "b": answer})
    listed = asyncio.run(session.runner.listing(["a", "b"]))
    assert {h: [t.to_json() for t in ts] for h, ts in listed.items()} == {
        "a": [{**t, "program": "", "fingerprint": ""} for t in targets], "b": [{**t, "program": "", "fingerprint": ""}
                                                                           for t in targets]}
    jobs = asyncio.run(session.runner.run("purge", ["a"], chosen={"a": [targets[0]["path"]]}))
    assert jobs["a"].ok and jobs["a"].records == [{"items": [targets[0]]}]
    dry, real = hosts["a"].commands
    assert "--dry-run" in dry and ("--only", targets[0]["path"]) == real[-2:] and targets[1]["path"] not in real


def test_a_host_going_away_and_coming_back_is_said_with_how_long():
    session, hosts, _ = _session(["a", "b"])
    hosts["b"].go_away("connection refused")
    session.collector.snapshot()
    hosts["b"].come_back()
    session.collector.snapshot()
    said = session.log.sentences()
    assert "b unreachable: connection refused" in said and any(s.startswith("b back after ") for s in said)
