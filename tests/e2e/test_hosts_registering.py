"""Three hosts under real torchrun agents (mount + UTS namespaces): each host's phase while the
service registers, on rank 0's events and its /health, and every record naming its host."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import get_json
from hosts import free_port, namespaces_work, stop
from hosts import hosts as make_hosts

from runtime.contract import REGISTERING, Health


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
                code, body, _ = get_json(f"{url}/health")
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
        code, body, _ = get_json(f"{url}/health")
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

