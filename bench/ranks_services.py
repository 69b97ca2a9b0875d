"""The services `dsv4 bench ranks` and `dsv4 bench node-loss` run: `dsv4 serve --ranks N` on
loopback, or two torchrun nodes of one rank each (docs/serving.md's multi-host recipe, on one
machine), until ready, stopped by SIGTERM and every process of it killed on the way out;
streamed completions against it; each rank process's PSS and RSS; and `dsv4 prepack --ranks N`,
timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_SEQ, MAX_SLOTS = 256, 16
START_TIMEOUT_S = 3600.0  # a cold launch of the small preset compiles every program on 2 cores
STOP_TIMEOUT_S = 60.0


@dataclass
class Service:
    proc: subprocess.Popen
    url: str
    started: float  # time.time() just before the process started
    events: Path
    ranks: int
    left_behind: list[int] = field(default_factory=list)  # sessions still running after the stop

    def rank_pids(self) -> list[int]:
        """The rank processes: the launcher's children for N > 1, the process itself for N = 1."""
        import psutil

        if self.ranks == 1:
            return [self.proc.pid]
        children = psutil.Process(self.proc.pid).children()
        return [c.pid for c in sorted(children, key=lambda c: int(c.environ().get("RANK", 0)))]


@contextlib.contextmanager
def serving(model: Path, cache: Path, run_dir: Path, backend: str, ranks: int,
            options: Sequence[str] = ("--max-slots", str(MAX_SLOTS)), device: str = "cpu") -> Iterator[Service]:
    """`dsv4 serve --ranks N --device D [options]` until the `serve` `end` event; stopped by SIGTERM
    (drained) on the way out, and on any error every process of it is killed: nothing is left
    behind."""
    run_dir.mkdir(parents=True)
    events, log = run_dir / "events.jsonl", run_dir / "serve.log"
    started = time.time()
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "console.cli", "serve", str(model), "--ranks", str(ranks), "--backend", backend,
             "--kernel-cache-dir", str(cache), "--device", device, "--port", "0", "--max-seq", str(MAX_SEQ),
             *options, "--queue-timeout", "3600", "--events", str(events)],
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    seen: set[int] = set()  # every rank pid ever seen, to kill them should the launcher go first
    stopped = None
    try:
        url = _wait_ready(proc, events, log, seen)
        service = Service(proc, url, started, events, ranks)
        seen.update(service.rank_pids())
        yield service
        _stop(proc, STOP_TIMEOUT_S)
        stopped = service
    finally:
        left = _kill(proc, seen)
        if stopped is not None and left:  # a clean stop should have ended every process of it
            stopped.left_behind = left
            print(f"{run_dir.name}: process groups {left} still ran after the stop; killed", file=sys.stderr)


def _wait_ready(proc: subprocess.Popen, events: Path, log: Path, seen: set[int]) -> str:
    import psutil

    deadline, offset, pending = time.monotonic() + START_TIMEOUT_S, 0, b""
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            seen.update(c.pid for c in psutil.Process(proc.pid).children())
        if events.exists():
            with open(events, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")  # a rank may be mid-line
            for line in lines:
                e = json.loads(line)
                if e.get("kind") == "error":
                    raise RuntimeError(f"rank {e.get('rank') or 0}, phase {e['phase']}: {e.get('message')}")
                if e.get("phase") == "serve" and e.get("kind") == "end":
                    return e["detail"]["url"]
        if proc.poll() is not None:
            raise RuntimeError(f"dsv4 serve exited with code {proc.returncode} before serving:\n"
                               f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"dsv4 serve was not ready within {START_TIMEOUT_S:g} s (log: {log})")


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM: rank 0 drains HTTP, then stops the other ranks; the launcher reaps them."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=timeout)


def _kill(proc: subprocess.Popen, ranks: set[int]) -> list[int]:
    """Kill whatever of this service still runs: its session (the launcher, or rank 0 and its
    compile workers) and each rank's own session. The sessions that still had a process."""
    left = []
    for pgid in (proc.pid, *sorted(ranks)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            left.append(pgid)
    proc.wait()
    return left


def run_load(url: str, clients: int, requests: int) -> dict[str, Any]:
    """`requests` streamed greedy completions, `clients` at a time: completion tokens per second,
    and (several ranks) the engine calls run meanwhile and rank 0's seconds in their all-to-alls."""
    from bench.service_bench import _request

    before = engine_stats(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: _request(url, i), range(requests)))
    wall = time.perf_counter() - t0
    after = engine_stats(url)
    tokens = sum(r[2] for r in results)
    out = {"clients": clients, "requests": requests, "tokens": tokens, "wall_s": round(wall, 3),
           "tokens_per_s": round(tokens / wall, 1), "mean_batch": after.get("mean_batch")}
    calls = after.get("engine_calls", 0) - before.get("engine_calls", 0)
    if calls:
        seconds = after["exchange_s"] - before["exchange_s"]
        out.update(engine_calls=calls, exchange_ms_per_call=round(seconds / calls * 1e3, 3),
                   exchange_share=round(seconds / wall, 3))
    return out


def engine_stats(url: str) -> dict[str, Any]:
    """The service's engine figures from /health (steps, mean batch; engine calls and all-to-all
    seconds of several ranks)."""
    import httpx

    from runtime.contract import Health

    return Health.from_json(httpx.get(f"{url}/health", timeout=60).json()).engine


def memory_of(service: Service, sidecar: Path) -> dict[str, Any]:
    """PSS and RSS of each rank process, and the PSS of its mapping of the sidecar: summed over
    the ranks, that is what the weights cost the host (one page-cache copy when not duplicated)."""
    import psutil

    per_rank = []
    for pid in service.rank_pids():
        proc = psutil.Process(pid)
        m = proc.memory_full_info()
        maps = [g for g in proc.memory_maps(grouped=True) if g.path == str(sidecar)]
        # RSS of the mapping: the sidecar pages this rank has mapped (its share of them: PSS)
        per_rank.append({"pid": pid, "pss": m.pss, "rss": m.rss, "sidecar_pss": sum(g.pss for g in maps),
                         "sidecar_rss": sum(g.rss for g in maps)})
    launcher = psutil.Process(service.proc.pid).memory_full_info().pss if service.ranks > 1 else None
    return {"per_rank": per_rank, "total_pss": sum(r["pss"] for r in per_rank),
            "sidecar_pss": sum(r["sidecar_pss"] for r in per_rank), "launcher_pss": launcher}


def prepack(model: Path, ranks: int) -> tuple[float, Path]:
    from store.sidecar.name import default_sidecar_path

    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "console.cli", "prepack", str(model), "--ranks", str(ranks)],
                       capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"dsv4 prepack --ranks {ranks} failed:\n{r.stderr[-2000:]}")
    return seconds, default_sidecar_path(model, ranks)



@dataclass
class Nodes:
    """Two torchrun agents, each with its rank: agents[k] is node k's `torchrun` process."""

    agents: list[subprocess.Popen]
    url: str
    events: Path

    def processes(self, node: int) -> list:
        """Node `node`'s agent and everything under it (torchrun starts a rank in a session of
        its own: signalling the agent's process group would miss it)."""
        import psutil

        agent = psutil.Process(self.agents[node].pid)
        return [agent, *agent.children(recursive=True)]


@contextlib.contextmanager
def torchrun_nodes(model: Path, run_dir: Path, options: Sequence[str] = ()) -> Iterator[Nodes]:
    """`torchrun --nnodes 2 --nproc-per-node 1 --node-rank K … -m console.cli serve MODEL`
    for K = 0, 1 on loopback until rank 0 serves; every process of both nodes is killed on the
    way out (SIGTERM to the agents first: each stops its rank)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events = run_dir / "events.jsonl"
    agents: list[subprocess.Popen] = []
    seen: set[int] = set()
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "runtime.launch.torchrun", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "console.cli", "serve", str(model), "--device", "cpu", "--port", "0",
                   "--events", str(events), *options]
            with open(run_dir / f"node{node}.log", "wb") as log:
                agents.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True))
        url = _wait_ready(agents[0], events, run_dir / "node0.log", seen)
        nodes = Nodes(agents, url, events)
        for k in (0, 1):
            seen.update(p.pid for p in nodes.processes(k))
        yield nodes
    finally:
        _end_agents(agents, seen)


def _end_agents(agents: list[subprocess.Popen], pids: set[int]) -> None:
    import psutil

    for a in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.pid, signal.SIGTERM)
    for a in agents:
        try:
            a.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    for pid in pids:  # a rank whose agent went first (or one still stopped)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
