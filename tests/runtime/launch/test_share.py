"""Programs across hosts (issue 35): the split of missing programs between hosts and the mode
with its reason, and waits at sync points that follow a slower rank's progress instead of a
fixed deadline — on a real rendezvous store."""

from __future__ import annotations

import os
import threading
import time

import pytest
from hosts import store_groups

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










