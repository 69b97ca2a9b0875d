"""A service across hosts while it registers and once it serves (issue 35): each host's phase and
progress and the slowest host, in rank 0's events and on its /health (503 `registering` until
ready); every record naming its host; three hosts under real torchrun agents."""

from __future__ import annotations

import socket
import time

from conftest import get_json
from hosts import store_groups

from runtime.contract import REGISTERING, Health, HostProgress
from runtime.events import Event
from runtime.launch.progress import HostsWatch, Progress, summarize

# ---- each host's progress, and the slowest ------------------------------------------------------


def test_each_host_shows_its_least_advanced_rank_and_the_one_furthest_behind_is_named():
    hosts = ["host-a", "host-a", "host-b", "host-c"]
    phases = {0: "kv", 1: "weights", 2: "programs", 3: "kv"}
    progress = {1: Progress(4, "weights", "progress", 6, 7, "layers"),
                2: Progress(9, "programs", "progress", 3, 8, "programs")}
    summary, slowest = summarize(hosts, phases, progress)
    assert [(h.host, h.ranks, h.phase) for h in summary] == [
        ("host-a", (0, 1), "weights"), ("host-b", (2,), "programs"), ("host-c", (3,), "kv")]
    assert slowest == "host-b" and summary[1].doing == "programs 3/8 programs"
    assert summary[0].doing == "weights 6/7 layers"  # host-a: its rank 1, not rank 0 ahead of it


def test_no_host_is_named_slowest_when_none_is_behind_another():
    assert summarize(["a", "b"], {0: "kv", 1: "kv"}, {})[1] == ""
    assert summarize(["a", "a"], {0: "kv", 1: "programs"}, {})[1] == ""  # one host: nobody to be behind


def test_rank_zero_reads_every_rank_on_the_store_and_says_each_change_of_phase_once():
    _store, groups = store_groups(3, ["host-a", "host-a", "host-b"])
    for g, phase in zip(groups, ("kv", "kv", "programs"), strict=True):
        g.set_phase(phase)
    groups[2].progress_sink(Event("programs", "progress", done=2, total=5, unit="programs", rank=2))
    told, said = [], []
    zero = groups[0]
    watch = HostsWatch(zero.hosts, zero.progress_of, lambda *a: told.append(a),
                       lambda message, detail: said.append((message, detail)), lambda rank: {})
    watch.once()
    watch.once()  # nothing changed: nothing said again
    ranks, hosts, slowest = told[-1]
    assert [r["host"] for r in ranks] == ["host-a", "host-a", "host-b"] and slowest == "host-b"
    assert [m for m, _ in said] == ["hosts: host-a kv; host-b programs 2/5 programs (slowest)"]
    assert [HostProgress.from_json(h) for h in said[0][1]["hosts"]] == list(hosts)
    groups[2].set_phase("kv")
    watch.once()
    assert said[-1][0] == "hosts: host-a kv; host-b kv" and said[-1][1]["slowest"] == ""


def test_rank_zero_s_word_on_the_hosts_is_not_its_own_progress():
    _store, (zero, _one) = store_groups()
    zero.progress_sink(Event("programs", "progress", done=1, total=4, unit="programs", rank=0))
    before = zero.progress_of(0)
    time.sleep(0.6)  # past the throttle: a progress event of its own would be posted now
    zero.progress_sink(Event("programs", "log", message="hosts: …", detail={"hosts": [], "slowest": ""}, rank=0))
    assert zero.progress_of(0) == before


# ---- /health while registering --------------------------------------------------------------------


def test_a_registering_service_answers_503_with_its_phase_each_host_and_the_slowest(tmp_path):
    from runtime.launch.spec import LaunchSpec
    from runtime.serve.registering import Registering, answer_while_registering
    from runtime.serve.server import bind, url_of
    from store.services import ServiceId

    status = Registering(LaunchSpec(tmp_path / "model", max_seq=64), ServiceId.of_this_process())
    status(Event("programs", "start", rank=0))
    status.hosts([{"rank": 0, "host": "host-a", "phase": "kv"}, {"rank": 1, "host": "host-b", "phase": "programs"}],
                 (HostProgress("host-a", (0,), "kv"), HostProgress("host-b", (1,), "programs", 3, 8, "programs",
                                                                    "programs")), "host-b")
    sock = bind("127.0.0.1", 0)
    stop_answering = answer_while_registering(sock, status)
    try:
        code, body, _ = get_json(f"{url_of(sock)}/health")
        health = Health.from_json(body)
        assert code == 503 and health.status == REGISTERING and health.registering and not health.ok
        assert health.phase == "programs" and health.slowest == "host-b"
        assert [(h.host, h.doing) for h in health.hosts] == [("host-a", "kv"), ("host-b", "programs 3/8 programs")]
        assert [(r.rank, r.host, r.phase) for r in health.ranks] == [(0, "host-a", "kv"), (1, "host-b", "programs")]
        assert health.reason == "registering: phase programs; slowest host host-b: programs 3/8 programs"
        code, body, headers = get_json(f"{url_of(sock)}/v1/completions", b'{"prompt": "x"}')
        assert code == 503 and body["error"]["code"] == "registering" and headers["Retry-After"] == "5"
    finally:
        stop_answering()
    with socket.create_connection(sock.getsockname()) as client:  # still listening: the server's now
        conn, _ = sock.accept()
        conn.close()
        client.close()
    sock.close()


# ---- three hosts under torchrun ---------------------------------------------------------------------






# ---- errors name their host -------------------------------------------------------------------------


def test_a_rank_that_loses_the_others_in_a_collective_names_itself_with_its_host():
    _store, (zero, _one) = store_groups()
    error = zero._lose(RuntimeError("Connection closed by peer"))
    assert str(error) == "rank 0 on host-a lost the other ranks in a collective (Connection closed by peer)"
    assert zero.errors[0] == str(error) and zero.aborted() == str(error)
