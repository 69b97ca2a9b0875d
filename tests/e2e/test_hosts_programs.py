"""A cold service over two hosts in mount + UTS namespaces, each with its own disks: every missing
program compiled once for the service and shipped signed; without trust each host compiles what it
misses."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace

import pytest
from conftest import launch
from hosts import free_port, namespaces_work, stop, trust_each_other
from hosts import hosts as make_hosts


def _serving(out, procs, ranks: int = 2, limit: float = 1200):
    """Every rank's events once rank 0 serves (a rank that dies first: its stderr)."""
    from runtime.events import parse

    deadline = time.monotonic() + limit
    while True:
        events = {r: [parse(line) for line in (out / f"events-{r}.jsonl").read_text().splitlines()]
                  if (out / f"events-{r}.jsonl").exists() else [] for r in range(ranks)}
        if any(e.phase == "serve" and e.kind == "end" for e in events[0]):
            return events
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        assert not dead, (out / f"stderr-{dead[0]}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the service did not come up"
        time.sleep(0.5)


def _served_once(out, hosts):
    """One export service over `hosts` until it serves, then stopped: every rank's events, and
    each rank's programs end detail."""
    out.mkdir()
    port = free_port()
    procs = [h.rank(r, len(hosts), port, out, backend="export") for r, h in enumerate(hosts)]
    try:
        events = _serving(out, procs, len(hosts))
    finally:
        stop(procs)
    return events, {r: _end(events[r], "programs").detail for r in range(len(hosts))}


def _end(events, phase):
    return next(e for e in events if e.phase == phase and e.kind == "end")


def _entries(host) -> dict[str, str]:
    """program → the host its entry came from ("" : built here), in that host's own cache."""
    out = {}
    for manifest in (host.root / "programs").rglob("manifest.json"):
        raw = json.loads(manifest.read_text())
        out[raw["program"]] = (raw.get("origin") or {}).get("host", "")
    return out


def test_a_cold_service_over_two_hosts_compiles_each_program_once_then_each_host_alone_without_trust(
        tiny_ckpt_ro, tmp_path):
    if why := namespaces_work():
        pytest.skip(why)
    a, b = make_hosts(tmp_path, tiny_ckpt_ro, ["host-a", "host-b"])
    b = replace(b, keys_by_flag=True)  # host-a's keys from the environment, host-b's from its launch flags
    trust_each_other([a, b])
    events, programs = _served_once(tmp_path / "cold", (a, b))
    sharing = programs[0]["sharing"]
    assert sharing["mode"] == "shared" and sharing == programs[1]["sharing"]
    here = [set(programs[r]["compiled_here"]) for r in (0, 1)]
    assert here[0] and here[1] and not here[0] & here[1]  # both hosts compiled, none twice
    every = set(programs[0]["programs"])
    assert here[0] | here[1] == every
    assert [programs[r]["received"] for r in (0, 1)] == [len(here[1]), len(here[0])]
    assert programs[0]["verify_s"] > 0 and programs[1]["verify_s"] > 0
    for h, other, mine in ((a, "host-b", here[0]), (b, "host-a", here[1])):
        entries = _entries(h)
        assert set(entries) == every  # each host's own cache holds every program now
        assert {p for p, origin in entries.items() if origin == other} == every - mine
    one_rank, _ = launch(tiny_ckpt_ro, backend="eager")  # greedy tokens as one rank's
    try:
        assert _end(events[0], "validate").detail["tokens"] == one_rank.validation_tokens
    finally:
        one_rank.close()

    # without trusted keys: each host compiles what it misses itself (host-b: one program)
    (a.root / "keys" / "trusted").unlink()
    (b.root / "keys" / "trusted").unlink()
    gone = sorted(here[0])[0]
    [entry] = [m.parent for m in (b.root / "programs").rglob("manifest.json") if f"/{gone}/" in str(m)]
    shutil.rmtree(entry)
    events, programs = _served_once(tmp_path / "alone", (a, b))
    assert programs[0]["sharing"]["mode"] == "each" and "no trusted keys" in programs[0]["sharing"]["why"]
    assert programs[0]["counts"].get("MISS", 0) == 0 and programs[1]["counts"]["MISS"] == 1
    assert "received" not in programs[1]

