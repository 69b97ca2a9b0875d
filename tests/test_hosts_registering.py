"""A service across hosts while it registers and once it serves (issue 35): each host's phase and
progress and the slowest host, in rank 0's events and on its /health (503 `registering` until
ready); every record naming its host; three hosts under real torchrun agents."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from hosts import free_port, namespaces_work, stop, store_groups
from hosts import hosts as make_hosts

from runtime.events import Event
from runtime.launch.progress import HostsWatch, Progress, summarize
from runtime.serve.contract import REGISTERING, Health, HostProgress


def _get(url: str, body: bytes | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) whatever the status."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


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
        code, body, _ = _get(f"{url_of(sock)}/health")
        health = Health.from_json(body)
        assert code == 503 and health.status == REGISTERING and health.registering and not health.ok
        assert health.phase == "programs" and health.slowest == "host-b"
        assert [(h.host, h.doing) for h in health.hosts] == [("host-a", "kv"), ("host-b", "programs 3/8 programs")]
        assert [(r.rank, r.host, r.phase) for r in health.ranks] == [(0, "host-a", "kv"), (1, "host-b", "programs")]
        assert health.reason == "registering: phase programs; slowest host host-b: programs 3/8 programs"
        code, body, headers = _get(f"{url_of(sock)}/v1/completions", b'{"prompt": "x"}')
        assert code == 503 and body["error"]["code"] == "registering" and headers["Retry-After"] == "5"
    finally:
        stop_answering()
    with socket.create_connection(sock.getsockname()) as client:  # still listening: the server's now
        conn, _ = sock.accept()
        conn.close()
        client.close()
    sock.close()


# ---- three hosts under torchrun ---------------------------------------------------------------------


def _events(path):
    from runtime.events import parse

    return [parse(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_three_hosts_under_torchrun_show_each_host_while_registering_and_every_record_names_its_host(
        tiny_ckpt_ro, tmp_path):
    """Four ranks on three namespaced hosts (2 + 1 + 1), each host its own checkpoint copy (other
    mtimes), a torchrun agent each; eager programs: nothing compiles."""
    if why := namespaces_work():
        pytest.skip(why)
    a, b, c = make_hosts(tmp_path, tiny_ckpt_ro, ["host-a", "host-b", "host-c"])
    out = tmp_path / "out"
    out.mkdir()
    port, http = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    procs = [a.node(0, 3, 2, port, out, "--port", str(http)), b.node(1, 3, 1, port, out), c.node(2, 3, 1, port, out)]
    answers: list[tuple[int, Health]] = []
    done = threading.Event()

    def poll() -> None:  # rank 0's /health from its first answer until it serves
        while not done.is_set():
            try:
                code, body, _ = _get(f"{url}/health")
                answers.append((code, Health.from_json(body)))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        deadline = time.monotonic() + 600
        while not any(e.phase == "serve" and e.kind == "end" for e in _events(out / "events-host-a.jsonl")):
            dead = [h for h, p in zip((a, b, c), procs, strict=True) if p.poll() is not None]
            assert not dead, (out / f"stderr-{dead[0].name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.3)
        code, body, _ = _get(f"{url}/health")
        serving = Health.from_json(body)
    finally:
        done.set()
        poller.join()
        stop(procs)
    assert code == 200 and serving.ok and not serving.hosts
    assert [(r.rank, r.host) for r in serving.ranks] == [(0, "host-a"), (1, "host-a"), (2, "host-b"), (3, "host-c")]

    registering = [h for code, h in answers if code == 503]
    assert registering and all(h.status == REGISTERING and h.phase for h in registering)
    assert any([h.host for h in r.hosts] == ["host-a", "host-b", "host-c"] for r in registering)
    for host in (a, b, c):  # every event names the host it came from, every rank of it under torchrun
        events = _events(out / f"events-{host.name}.jsonl")
        assert events and {e.host for e in events} == {host.name}
        assert {e.detail["store"] for e in events if e.phase == "check" and e.kind == "end"} == {"torchrun's agent"}
    said = [e for e in _events(out / "events-host-a.jsonl") if e.rank == 0 and "hosts" in e.detail]
    assert said and said[0].message.startswith("hosts: host-a ")
    assert [h["host"] for h in said[0].detail["hosts"]] == ["host-a", "host-b", "host-c"]
    [record] = [json.loads(line) for line in (a.root / "state" / "launches.jsonl").read_text().splitlines()][:1]
    assert record["host"] == "host-a" and record["hosts"] == ["host-a", "host-a", "host-b", "host-c"]


# ---- errors name their host -------------------------------------------------------------------------


def test_a_rank_that_loses_the_others_in_a_collective_names_itself_with_its_host():
    _store, (zero, _one) = store_groups()
    error = zero._lose(RuntimeError("Connection closed by peer"))
    assert str(error) == "rank 0 on host-a lost the other ranks in a collective (Connection closed by peer)"
    assert zero.errors[0] == str(error) and zero.aborted() == str(error)
