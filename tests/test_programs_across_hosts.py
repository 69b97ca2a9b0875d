"""Programs across hosts (issue 35): the split of missing programs between hosts and the mode
with its reason, and waits at sync points that follow a slower rank's progress instead of a
fixed deadline — on a real rendezvous store."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import replace

import pytest
from conftest import launch
from hosts import free_port, namespaces_work, stop, store_groups, trust_each_other
from hosts import hosts as make_hosts

from runtime.events import Event
from runtime.launch.rank_store import RankError
from runtime.launch.share import EACH, ONE_HOST, SHARED, HostView, Keys, decide

ALL = ("attn", "moe", "mtp", "embed", "head")


def _view(rank, host, missing=ALL, seconds=None, signer="k", trusts=("k",)):
    return HostView(rank, host, tuple(missing), seconds or {}, signer, tuple(trusts))


def test_programs_missing_everywhere_are_split_longest_first_and_none_twice():
    seconds = {"attn": 30.0, "moe": 20.0, "mtp": 12.0, "embed": 9.0, "head": 8.0}
    s = decide([_view(0, "a", seconds=seconds, signer="ka", trusts=("kb",)),
                _view(2, "b", signer="kb", trusts=("ka",))])
    assert s.mode == SHARED and s.leaders == [0, 2]
    assert s.compiles == {0: ("attn", "embed"), 2: ("moe", "mtp", "head")}  # 39 s vs 40 s, longest first
    compiled = [p for share in s.compiles.values() for p in share]
    assert sorted(compiled) == sorted(ALL)  # every program once in the service
    assert s.ships == s.compiles


def test_a_program_one_host_holds_is_shipped_by_it_not_compiled():
    s = decide([_view(0, "a", missing=("attn", "moe"), signer="ka", trusts=("kb",)),
                _view(1, "b", missing=ALL, signer="kb", trusts=("ka",))])
    assert s.mode == SHARED
    assert sorted(p for share in s.compiles.values() for p in share) == ["attn", "moe"]
    assert {"mtp", "embed", "head"} <= set(s.ships[0])


@pytest.mark.parametrize(("views", "says"), [
    ([_view(0, "a", signer="", trusts=()), _view(1, "b")], "a cannot sign its entries"),
    ([_view(0, "a", signer="ka", trusts=("ka",)), _view(1, "b", signer="kb", trusts=("ka", "kb"))],
     "a does not trust b's key kb"),
])
def test_without_trust_every_host_compiles_what_it_misses_and_says_why(views, says):
    s = decide(views)
    assert s.mode == EACH and says in s.why and "each host compiles for itself" in s.why
    assert s.compiles == {0: ALL, 1: ALL} and not any(s.ships.values())


def test_one_host_is_its_own_mode():
    s = decide([_view(0, "a", signer="")])
    assert s.mode == ONE_HOST and s.compiles == {0: ALL}


def test_a_host_view_round_trips():
    v = _view(3, "host-c", missing=("attn",), seconds={"attn": 1.5}, trusts=("k1", "k2"))
    assert HostView.from_line(v.line()) == v


def test_a_launch_takes_its_keys_from_its_flags_before_the_environment(tmp_path, monkeypatch, tiny_ckpt_ro):
    from conftest import MAX_SEQ

    from runtime.launch.plan import make_plan
    from runtime.launch.spec import PLAN, SERVE, LaunchSpec, parse
    from store.signing import SigningKey

    key = SigningKey.generate("flagged")
    private, trusted = tmp_path / "signing.key", tmp_path / "trusted"
    with os.fdopen(os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key.line() + "\n")
    trusted.write_text(key.public.line() + "\n")
    monkeypatch.setenv("DSV4_SIGNING_KEY", str(tmp_path / "no-such.key"))
    monkeypatch.delenv("DSV4_TRUSTED_KEYS", raising=False)
    assert "no trusted keys (--trusted-keys or $DSV4_TRUSTED_KEYS)" in Keys.of(LaunchSpec()).why
    flags = ["--signing-key", str(private), "--trusted-keys", str(trusted)]
    keys = Keys.of(parse(flags, SERVE))
    assert keys.why == "" and keys.signing.public.id == key.public.id and list(keys.trusted.keys) == [key.public.id]
    plan = make_plan(parse([str(tiny_ckpt_ro), "--backend", "export", "--device", "cpu", "--max-seq", str(MAX_SEQ),
                            *flags], PLAN))
    assert f"shipped signed by key {key.public.id}" in plan.across_hosts


# ---- waits that follow progress ----------------------------------------------------------------


def test_a_slow_rank_that_makes_progress_is_waited_for_past_any_fixed_deadline(monkeypatch):
    from runtime.launch import rank_store

    monkeypatch.setattr(rank_store, "SHOW_WAIT_EVERY_S", 0.5)
    _store, (zero, one) = store_groups()
    shown: list[str] = []

    def slow_but_moving():  # 3 s of work, an event every 0.6 s: past the 1 s rendezvous timeout
        for i in range(5):
            one.progress_sink(Event("programs", "progress", done=i + 1, total=5, unit="programs", rank=1))
            time.sleep(0.6)
        one.post("kv-measure")

    worker = threading.Thread(target=slow_but_moving)
    worker.start()
    try:
        zero.gather("kv-measure", "", "kv", stall=1.5, shown=shown.append)
    finally:
        worker.join()
    assert any(line.startswith("waiting for rank 1 on host-b: programs ") for line in shown), shown


def test_a_rank_whose_progress_stops_is_named_with_its_host_and_what_it_did_last():
    _store, (zero, one) = store_groups()
    one.set_phase("weights")
    one.progress_sink(Event("weights", "progress", done=3, total=8, unit="layers", rank=1))
    with pytest.raises(RankError) as raised:
        zero.gather("kv-measure", "", "kv", stall=1.0)
    assert str(raised.value) == ("kv: rank 1 on host-b made no progress for 1 s (--stall-timeout) while the "
                                 "others waited for it; its last: weights 3/8 layers")


def test_without_a_stall_bound_a_missing_rank_is_named_at_the_deadline():
    _store, (zero, _one) = store_groups()
    with pytest.raises(RankError, match=r"^rendezvous: rank 1 did not arrive within 1 s$"):
        zero.gather("join", "", "rendezvous")


# ---- a service over two hosts, each with its own disks --------------------------------------------


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
