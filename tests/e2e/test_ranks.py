"""Rank processes (issues 15, 25): `dsv4 serve --ranks N` is N processes over torch.distributed
(gloo), rank 0 serving HTTP and leading every step, each rank holding its own sequences' KV;
greedy tokens equal one rank's, alone or 16 at once; a rank that dies stops the whole service
promptly and says which; a rank that never joins, or joins with other settings, is named;
nothing is left running."""

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest
from conftest import MAX_SEQ, start_server

from bench.node_loss_bench import health_status, post_status
from runtime.contract import Health
from runtime.events import parse

PROMPTS = ["The quick brown fox", "DeepSeek V4", "a", "0123456789 " * 4]
CONCURRENT = [f"request {i}: " + "abcdefgh"[i % 8] * (1 + i % 5) for i in range(16)]
PER_RANK_SLOTS = 8


def _complete(url: str, prompt: str, n: int = 10) -> list[int]:
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _health(url: str) -> tuple[int, Health]:
    return health_status(url, timeout=10)


def _events(path) -> list:
    return [parse(line) for line in path.read_text().splitlines()]


def _ranks_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The rank processes the launcher started (each in its own session)."""
    return [p for p in psutil.Process(proc.pid).children() if "serve" in " ".join(p.cmdline())]


def _stop(proc: subprocess.Popen, ranks: list[psutil.Process]) -> int:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    _, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, f"ranks left behind: {alive}"
    return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_tokens(tiny_ckpt_ro, tmp_path_factory):
    proc, url, _ = start_server(tiny_ckpt_ro, tmp_path_factory.mktemp("r1"), "--backend", "eager")
    try:
        return [_complete(url, p) for p in PROMPTS]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def one_rank_alone(tiny_ckpt_ro, tmp_path_factory):
    """One rank's greedy tokens of each CONCURRENT prompt, one request at a time."""
    proc, url, _ = start_server(tiny_ckpt_ro, tmp_path_factory.mktemp("alone"), "--backend", "eager")
    try:
        return [_complete(url, p, 12) for p in CONCURRENT]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sixteen_concurrent_requests_over_ranks_decode_as_one_rank_alone(tiny_ckpt_ro, tmp_path, one_rank_alone,
                                                                        ranks):
    """Each rank owns its own slots (--device-memory: each rank's simulated device) and the
    sequences placed in them; 16 requests at once, MTP drafting per rank, give the tokens one
    rank gives each request alone."""
    proc, url, events = start_server(tiny_ckpt_ro, tmp_path, "--ranks", str(ranks), "--backend", "eager",
                                     "--speculative", "mtp", "--device-memory", "4G",
                                     "--max-slots", str(PER_RANK_SLOTS))
    ranks_seen = _ranks_of(proc) if ranks > 1 else []
    try:
        status, health = _health(url)
        assert status == 200 and health.slots == ranks * PER_RANK_SLOTS
        assert [(r.rank, r.slots) for r in health.ranks] == [(r, PER_RANK_SLOTS) for r in range(ranks)]
        with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
            got = list(pool.map(lambda p: _complete(url, p, 12), CONCURRENT))
        assert got == one_rank_alone
        _, health = _health(url)
        assert health.free_slots == health.slots and health.engine["drafts"] > 0
    finally:
        if ranks > 1:
            assert _stop(proc, ranks_seen) == 0
        else:
            proc.terminate()
            proc.wait(timeout=60)
    kv = {e.rank: e.detail for e in _events(events) if e.phase == "kv" and e.kind == "end"}
    assert [kv[r]["slots"] for r in sorted(kv)] == [PER_RANK_SLOTS] * ranks
    if ranks > 1:
        assert kv[0]["rank_slots"] == [PER_RANK_SLOTS] * ranks and "ranks_sharing_memory" not in kv[0]


def test_two_ranks_compiled_equal_one_rank(tiny_ckpt, tmp_path, one_rank_tokens):
    """export programs: rank 0 compiles each key once, rank 1 HITs them; each rank maps the
    2-rank sidecar's shared weights and its own experts; tokens as one rank's."""
    from console.cli import main

    assert main(["prepack", str(tiny_ckpt), "--ranks", "2"]) == 0
    cache = tmp_path / "programs"
    proc, url, events = start_server(tiny_ckpt, tmp_path, "--ranks", "2", "--backend", "export",
                                     "--kernel-cache-dir", str(cache))
    ranks = _ranks_of(proc)
    try:
        assert len(ranks) == 2
        assert [_complete(url, p) for p in PROMPTS] == one_rank_tokens
        status, health = _health(url)
        assert status == 200 and health.ok
    finally:
        assert _stop(proc, ranks) == 0
    seen = _events(events)
    ends = {(e.rank, e.phase): e for e in seen if e.kind == "end"}
    for rank in (0, 1):
        for phase in ("check", "programs", "weights", "upload", "kv", "validate"):
            assert (rank, phase) in ends, (rank, phase)
    assert (0, "serve") in ends and (1, "serve") not in ends  # only rank 0 serves HTTP
    counts = {r: ends[(r, "programs")].detail["counts"] for r in (0, 1)}
    assert counts[0]["MISS"] == len(ends[(0, "programs")].detail["programs"])  # compiled once, by rank 0
    assert counts[1]["HIT"] == counts[0]["MISS"] and counts[1]["MISS"] == 0
    # each rank maps the shared weights and half of the routed experts, from the sidecar
    weights = [ends[(r, "weights")].detail for r in (0, 1)]
    assert [w["path"] for w in weights] == ["MAP", "MAP"]
    assert weights[0]["shared_bytes"] == weights[1]["shared_bytes"] > 0
    assert weights[0]["expert_bytes"] == weights[1]["expert_bytes"] > 0
    assert ends[(0, "upload")].detail["bytes"] == ends[(1, "upload")].detail["bytes"]
    kv = [ends[(r, "kv")].detail for r in (0, 1)]
    assert kv[0]["slots"] == kv[1]["slots"] and kv[0]["ranks_sharing_memory"] == 2  # host memory, split
    assert kv[0]["total_slots"] == kv[0]["slots"] + kv[1]["slots"] and health.slots == kv[0]["total_slots"]


def test_four_ranks_equal_one_rank_and_map_less(tiny_ckpt_ro, tmp_path, one_rank_tokens):
    proc, url, events = start_server(tiny_ckpt_ro, tmp_path, "--ranks", "4", "--backend", "eager")
    ranks = _ranks_of(proc)
    try:
        assert len(ranks) == 4
        assert [_complete(url, p) for p in PROMPTS] == one_rank_tokens
    finally:
        assert _stop(proc, ranks) == 0
    uploads = {e.rank: e.detail["bytes"] for e in _events(events) if e.phase == "upload" and e.kind == "end"}
    assert sorted(uploads) == [0, 1, 2, 3] and len(set(uploads.values())) == 1


def test_a_killed_rank_stops_the_service(tiny_ckpt_ro, tmp_path):
    from store import services
    from store.history import read_history

    proc, url, events = start_server(tiny_ckpt_ro, tmp_path, "--ranks", "2", "--backend", "eager")
    ranks = _ranks_of(proc)
    try:  # a failed look must not leave the service running
        def health_now() -> Health:
            return Health.from_json(json.loads(urllib.request.urlopen(f"{url}/health", timeout=30).read()))

        deadline = time.time() + 30  # rank 1 reaches serve a beat after rank 0 answers
        while (health := health_now()).ranks[1].phase != "serve" and time.time() < deadline:
            time.sleep(0.2)
        assert health.pid == proc.pid  # the service is its launcher; its ranks are its children
        assert [(r.rank, r.pid, r.device, r.phase) for r in health.ranks] == [
            (0, ranks[0].pid if ranks[0].environ().get("RANK") == "0" else ranks[1].pid, "cpu", "serve"),
            (1, next(p.pid for p in ranks if p.environ().get("RANK") == "1"), "cpu", "serve")]
        assert health.ranks[1].heartbeat_age is not None and health.ranks[1].heartbeat_age < 60
    except BaseException:
        _stop(proc, ranks)
        raise
    follower = next(p for p in ranks if p.environ().get("RANK") == "1")
    follower.send_signal(signal.SIGKILL)
    statuses = []
    deadline = time.time() + 30
    while proc.poll() is None and time.time() < deadline:
        with contextlib.suppress(urllib.error.URLError, ConnectionError):  # rank 0 stopped listening
            statuses.append(_health(url))
        time.sleep(0.1)
    assert proc.wait(timeout=30) != 0
    _, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive
    failed = [h for s, h in statuses if s == 503]
    assert failed, statuses
    assert "rank 1" in failed[0].reason and "SIGKILL" in failed[0].reason
    assert "during phase serve" in failed[0].reason
    # the dead rank's last error is its own line in /health's ranks, the launcher's words on it
    assert failed[0].ranks[1].error == failed[0].reason and not failed[0].ranks[0].error
    err = (tmp_path / "stderr.log").read_text()
    assert "rank 1" in err and "SIGKILL" in err
    errors = [e for e in _events(events) if e.kind == "error"]
    assert len(errors) == 1 and errors[0].message == failed[0].reason  # one death, one event
    assert errors[0].detail == {"rank": 1, "phase": "serve"} and f"on {socket.gethostname()}" in errors[0].message
    [record] = [r for r in read_history() if r.get("model") == str(tiny_ckpt_ro)]  # one record of the launch
    assert record["outcome"] == "error" and "rank 1" in record["error"] and record["pid"] == proc.pid
    [ended] = services.services()  # the service stays a row, saying how it ended
    assert (ended.pid, ended.ending.how, ended.ending.phase) == (proc.pid, "rank 1 killed by SIGKILL", "serve")
    assert "dsv4 sidecar status" not in err  # advice that does not apply is not given (the log says the phases)


def _rank(model, rank: int, world: int, port: int, tmp_path, *extra) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(model), "--device", "cpu",
                             "--backend", "eager", "--port", "0", "--max-seq", str(MAX_SEQ), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_rank_that_never_joins_is_named(tiny_ckpt_ro, tmp_path):
    proc = _rank(tiny_ckpt_ro, 0, 4, _free_port(), tmp_path, "--rendezvous-timeout", "2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "rank 1, 2, 3 did not arrive within 2 s" in err and "Traceback" not in err


def test_ranks_with_other_settings_are_refused(tiny_ckpt_ro, tmp_path):
    port = _free_port()
    lead = _rank(tiny_ckpt_ro, 0, 2, port, tmp_path)
    other = _rank(tiny_ckpt_ro, 1, 2, port, tmp_path, "--max-slots", "3")
    errs = [p.communicate(timeout=120)[1] for p in (lead, other)]
    assert lead.returncode != 0 and other.returncode != 0
    for err in errs:
        host = socket.gethostname()
        assert f"rank 1 on {host} differs from rank 0 on {host} in max_slots" in err and "Traceback" not in err


@pytest.mark.parametrize("args, says", [
    (["--ranks", "3"], "divide"),
    (["--ranks", "2", "--ready", "early"], "--ready early"),
    (["--ranks", "0"], "--ranks 0 is out of range"),
])
def test_bad_rank_settings_are_one_line(tiny_ckpt_ro, args, says):
    out = subprocess.run([sys.executable, "-m", "console.cli", "serve", str(tiny_ckpt_ro), "--port", "0", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def _serve_with_port_held(model, *args: str) -> tuple[int, subprocess.CompletedProcess]:
    """`dsv4 serve MODEL --ranks 2 ARGS` while a socket holds a port; `{port}` in ARGS is it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "console.cli", "serve", str(model), "--ranks", "2",
                              *(a.format(port=port) for a in args)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    return port, out


def test_master_port_in_use_is_one_line(tiny_ckpt_ro):
    port, out = _serve_with_port_held(tiny_ckpt_ro, "--port", "0", "--master-port", "{port}")
    assert f"MASTER_PORT {port}" in out.stderr and "in use" in out.stderr


def _torchrun_nodes(model, tmp_path, *extra: str):
    """Two "hosts": two torchrun agents (--nnodes 2, one rank each) on this machine, as the
    README's recipe starts them (bench.ranks_services.torchrun_nodes)."""
    from bench.ranks_services import torchrun_nodes

    return torchrun_nodes(model, tmp_path, ("--backend", "eager", "--max-seq", str(MAX_SEQ), *extra))


def test_two_torchrun_node_groups_form_one_service(tiny_ckpt_ro, tmp_path, one_rank_tokens):
    with _torchrun_nodes(tiny_ckpt_ro, tmp_path) as nodes:
        assert [_complete(nodes.url, p) for p in PROMPTS] == one_rank_tokens
        checks = {e.rank: e.detail for e in _events(nodes.events) if e.phase == "check" and e.kind == "end"}
    assert sorted(checks) == [0, 1]
    assert {d["store"] for d in checks.values()} == {"torchrun's agent"}  # no second store


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_lost_node_fails_closed_with_503s_never_a_5xx(tiny_ckpt_ro, tmp_path, how):
    """Node 1 (its agent and its rank) killed, or stopped, as a host that loses power or
    network would be, under load: node 0 answers 503 naming rank 1, every request in flight
    gets a 503 (or had finished), never another 5xx or a hang, and node 0 exits non-zero."""
    with _torchrun_nodes(tiny_ckpt_ro, tmp_path, "--rank-timeout", "2", "--max-slots", "1",
                         "--queue-timeout", "120") as nodes, concurrent.futures.ThreadPoolExecutor(8) as pool:
        # two slots: two requests decode, six wait in the queue when the node goes
        inflight = [pool.submit(post_status, nodes.url, f"in flight {i}", MAX_SEQ - 16) for i in range(8)]
        time.sleep(0.5)
        for p in nodes.processes(1):  # the agent and its rank
            p.send_signal(how)
        health = None
        deadline = time.time() + 60  # a hang guard, not a bound: `dsv4 bench node-loss` measures the time
        while time.time() < deadline and nodes.agents[0].poll() is None:
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                status, value = _health(nodes.url)
                if status == 503:
                    health = value
                    break
            time.sleep(0.1)
        statuses = [f.result(timeout=120) for f in inflight]
        assert health is not None, (tmp_path / "node0.log").read_text()[-3000:]
        assert "rank 1 on " in health.reason and "during phase serve" in health.reason
        assert health.ranks[1].error.startswith("rank 1 on ")  # the silent rank's line, by its rank
        assert set(statuses) <= {200, 503} and 503 in statuses, statuses
        assert nodes.agents[0].wait(timeout=60) != 0  # node 0's agent reports the failure
    from console.cli.node import node_reason
    from store.history import read_history

    node0 = (tmp_path / "node0.log").read_text()  # a host lost is lines with its cause, never a traceback
    assert "Traceback" not in node0 and "To enable traceback" not in node0, node0[-3000:]
    assert "rank 1 on " in node_reason(str(tmp_path / "node0.log"))

    record = [r for r in read_history() if r.get("model") == str(tiny_ckpt_ro)][-1]
    assert record["outcome"] == "error" and "rank 1" in record["error"]


def test_more_ranks_than_devices_is_one_line(tiny_ckpt_ro, monkeypatch, capsys):
    """An accelerator host with two GPUs: a third rank has no device of its own."""
    from console.cli import main

    monkeypatch.setattr("runtime.launch.hardware.resolve_device", lambda name: "cuda")
    monkeypatch.setattr("runtime.launch.hardware.accelerator_count", lambda device: 2)
    assert main(["serve", str(tiny_ckpt_ro), "--port", "0", "--ranks", "4"]) != 0
    err = capsys.readouterr().err
    assert "--ranks 4 but this host has 2 cuda device(s)" in err and len(err.strip().splitlines()) == 1


def test_http_port_in_use_is_one_line_before_any_rank(tiny_ckpt_ro):
    port, out = _serve_with_port_held(tiny_ckpt_ro, "--port", "{port}")
    assert f"127.0.0.1:{port}" in out.stderr
