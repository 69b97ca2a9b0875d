"""`dsv4 bench console`: first paint of `dsv4-console` and its CPU use while idle.

The console runs as an operator would start it, in a pseudo-terminal (180 × 50), read-only,
on a tiny synthetic checkpoint in throwaway user dirs. First paint = from spawn until the
footer's key hints reach the terminal (the whole screen is composed by then). Idle CPU = the
console process's user + system CPU seconds over `idle_seconds` of wall time at the default
refresh interval, as a percentage of one core (children included, though an idle console
has none), with the kernel cache view (`c`) showing a cache of 1,000 synthetic entries (a quarter
stale) the whole time: every entry judged against the plan, as an operator sees them.

With services: the same idle window while three `dsv4 serve` of the checkpoint run under load
(each refresh asks every one for /health and /metrics), and a refresh's seconds — one
`Collectors.snapshot()`, what the console runs off its UI thread — median and worst of ten.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.synthetic_cache import synthetic_cache

TARGETS = {"first_paint_s": 1.0, "idle_cpu_percent": 3.0, "fallback_residency_percent": 2.0, "refresh_s": 0.5,
           "fleet_refresh_s": 2.0}
FLEET_HOSTS = 16
SERVICES = 3
SPARSE_GIB = 300  # a V4-Flash-sized sidecar
MARKER = b"Quit"  # the footer's first hint: painted with the first full screen
CACHE_ENTRIES = 1000  # shown in the kernel cache view during the idle window
SHOWN = f"{CACHE_ENTRIES} entries".encode()  # the view's title once its entries arrived
SIZE = (50, 180)


def _env(base: Path) -> dict[str, str]:
    (base / "run").mkdir(mode=0o700, exist_ok=True)  # the fleet's ssh control sockets: its own, findable
    return {**os.environ, "TERM": "xterm-256color", "DSV4_DEFAULT_PRESET": "tiny",
            "DSV4_DATA_DIR": str(base / "data"), "DSV4_STATE_DIR": str(base / "state"),
            "DSV4_KERNEL_CACHE_DIR": str(base / "programs"), "XDG_RUNTIME_DIR": str(base / "run")}


def _serve(model: Path, base: Path, env: dict[str, str], n: int) -> tuple[list[subprocess.Popen], list[str]]:
    """`n` services of `model` (eager: nothing to compile) in the bench's user dirs; their URLs."""
    from runtime.events import parse

    procs, urls = [], []
    for i in range(n):
        events = base / f"serve-{i}.events.jsonl"
        procs.append(subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(model), "--backend", "eager",
                                       "--device", "cpu", "--port", "0", "--max-seq", "64", "--events", str(events)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 300
    for i, proc in enumerate(procs):
        events = base / f"serve-{i}.events.jsonl"
        while not urls[i:] and time.monotonic() < deadline and proc.poll() is None:
            for line in (events.read_text().splitlines() if events.exists() else []):
                e = parse(line)
                if e.phase == "serve" and e.kind == "end":
                    urls.append(e.detail["url"])
            time.sleep(0.2)
    if len(urls) < n:
        raise RuntimeError(f"{n - len(urls)} of {n} services did not start")
    return procs, urls


def _load(urls: list[str], stop: threading.Event) -> None:
    """Requests to every service, one after another, until `stop`: what the console watches."""
    import httpx

    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    client.post(f"{url}/v1/completions", json={"prompt": "the sea", "max_tokens": 16})


REFRESH = """
import json, sys, time
from console.data.collectors import Collectors, console_spec
collectors = Collectors(console_spec(sys.argv[1], device="cpu", backend="eager", max_seq=64))
out = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    collectors.snapshot()
    out.append(time.perf_counter() - t0)
    time.sleep(0.5)
print(json.dumps(out))
"""


def _refresh_seconds(model: Path, env: dict[str, str], n: int = 10) -> list[float]:
    """Seconds of `n` console refreshes (`Collectors.snapshot()`) in the bench's user dirs, in a
    child process (bench never imports console/)."""
    out = subprocess.run([sys.executable, "-c", REFRESH, str(model), str(n)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


FLEET_REFRESH = """
import json, sys, time
from console.fleet.flags import session_from
from console.tui.args import build_parser
setup = session_from(build_parser().parse_args(["--fleet", sys.argv[1]]))
try:
    first = setup.collector.first(300)
    out, fresh = [], []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        snap = setup.collector.snapshot(wait=30)
        out.append(time.perf_counter() - t0)
        fresh.append(sum(r.fresh for r in snap.hosts))
        time.sleep(0.5)
    print(json.dumps({"seconds": out, "fresh": fresh, "errors": [r.error for r in first.hosts if r.error]}))
finally:
    setup.close()
"""


def _tree_cpu(ps: psutil.Process, control: str) -> float:
    """CPU seconds of the console, its live children (the ssh clients of its streams) and the ssh
    masters sharing its connections (daemons once forked: found by their control socket dir)."""
    total = _cpu(ps)
    with contextlib.suppress(psutil.Error):
        for child in ps.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += _cpu(child)
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if any(control in arg for arg in proc.info["cmdline"] or ()) and "[mux]" in " ".join(proc.info["cmdline"]):
                total += _cpu(proc)
    return total


def measure_fleet(hosts: int = 16, idle_seconds: float = 30.0, interval: float = 2.0) -> dict[str, Any]:
    """`hosts` namespaced sshd hosts on loopback (bench.ssh_hosts), each with a tiny checkpoint:
    a refresh's seconds (every host asked for a snapshot and answered, median and worst of ten),
    then the fleet console in a pseudo-terminal: first paint with every host reachable, and its
    CPU while idle (its ssh clients and masters included)."""
    import shutil

    from bench.ssh_hosts import fleet_file, ssh_hosts

    sshd = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd",) if os.access(p, os.X_OK)), None)
    if sshd is None or os.geteuid() != 0:
        return {"hosts": hosts, "skipped": "needs root and sshd (Debian's openssh-server)"}
    with tempfile.TemporaryDirectory(prefix="dsv4-fleet-bench-") as tmp:
        base = Path(tmp)
        env = _env(base)
        model = base / "model"
        subprocess.run([sys.executable, "-m", "console.cli", "synth", "--preset", "tiny", str(model)],
                       env=env, check=True, capture_output=True)
        names = [f"host-{i:02d}" for i in range(hosts)]
        with ssh_hosts(base / "bed", names, sshd, model=model) as (bed, config):
            path = fleet_file(base / "fleet.toml", bed, config,
                              launch={"model": str(bed[0].mount / "model"), "backend": "export", "max_seq": 64})
            out = subprocess.run([sys.executable, "-c", FLEET_REFRESH, str(path), "10"], env=env, capture_output=True,
                                 text=True, check=True)
            refresh = json.loads(out.stdout)
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", SIZE[0], SIZE[1], 0, 0))
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "console.tui.app", "--readonly", "--fleet", str(path),
                                     "--interval", str(interval)], stdin=slave, stdout=slave, stderr=slave, env=env,
                                    close_fds=True, start_new_session=True)
            os.close(slave)
            stop = threading.Event()
            try:
                ready = _wait_for(master, f"({hosts} reachable)".encode(), timeout=300.0)
                if ready is None:
                    raise RuntimeError(f"the fleet console did not show {hosts} reachable hosts within 300 s")
                threading.Thread(target=_drain, args=(master, stop), daemon=True).start()
                time.sleep(min(3.0, idle_seconds))
                ps = psutil.Process(proc.pid)
                c0, o0, w0 = _tree_cpu(ps, env["XDG_RUNTIME_DIR"]), _cpu(ps), time.perf_counter()
                time.sleep(idle_seconds)
                c1, o1, w1 = _tree_cpu(ps, env["XDG_RUNTIME_DIR"]), _cpu(ps), time.perf_counter()
            finally:
                stop.set()
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                os.close(master)
    seconds = sorted(refresh["seconds"])
    idle_cpu = 100.0 * (c1 - c0) / (w1 - w0)
    return {"hosts": hosts, "refresh_median_s": round(seconds[len(seconds) // 2], 4),
            "refresh_max_s": round(seconds[-1], 4), "fresh": refresh["fresh"], "errors": refresh["errors"],
            "all_reachable_s": round(ready - t0, 3), "idle_cpu_percent": round(idle_cpu, 2),
            "console_only_cpu_percent": round(100.0 * (o1 - o0) / (w1 - w0), 2),
            "idle_seconds": idle_seconds, "interval_s": interval,
            "met": {"fleet_refresh_s": seconds[-1] <= TARGETS["fleet_refresh_s"],
                    "idle_cpu_percent": idle_cpu <= TARGETS["idle_cpu_percent"]}}


def measure(idle_seconds: float = 30.0, interval: float = 2.0, services: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dsv4-console-bench-") as tmp:
        base = Path(tmp)
        env = _env(base)
        model = base / "model"
        subprocess.run([sys.executable, "-m", "console.cli", "synth", "--preset", "tiny", str(model)],
                       env=env, check=True, capture_output=True)
        synthetic_cache(base / "programs", CACHE_ENTRIES)  # the view the idle window shows
        served, loading, refresh = [], threading.Event(), []
        if services:
            served, urls = _serve(model, base, env, services)
            for _ in range(2):
                threading.Thread(target=_load, args=(urls, loading), daemon=True).start()
            refresh = _refresh_seconds(model, env)
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", SIZE[0], SIZE[1], 0, 0))
        argv = [sys.executable, "-m", "console.tui.app", "--readonly", "--model", str(model),
                "--interval", str(interval)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                start_new_session=True)
        os.close(slave)
        try:
            first_paint = _wait_for(master, MARKER, timeout=30.0)
            if first_paint is None:
                raise RuntimeError("dsv4-console did not paint within 30 s")
            first_paint -= t0
            os.write(master, b"c")  # the kernel cache's contents, every entry judged against the plan
            pressed = time.perf_counter()
            shown = _wait_for(master, SHOWN, timeout=60.0)
            if shown is None:
                raise RuntimeError(f"dsv4-console did not show the kernel cache's {CACHE_ENTRIES} entries within 60 s")
            stop = threading.Event()
            drain = threading.Thread(target=_drain, args=(master, stop), daemon=True)
            drain.start()
            time.sleep(min(3.0, idle_seconds))  # let the first collection finish before the window
            ps = psutil.Process(proc.pid)
            c0, w0 = _cpu(ps), time.perf_counter()
            time.sleep(idle_seconds)
            c1, w1 = _cpu(ps), time.perf_counter()
            rss = ps.memory_info().rss
            stop.set()
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(master)
            loading.set()
            for p in served:  # each by its pid
                p.terminate()
            for p in served:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(60)
                if p.poll() is None:
                    p.kill()
    idle_cpu = 100.0 * (c1 - c0) / (w1 - w0)
    refresh = sorted(refresh)
    return {"services": services, "refresh_median_s": round(refresh[len(refresh) // 2], 4) if refresh else None,
            "refresh_max_s": round(refresh[-1], 4) if refresh else None,
            "first_paint_s": round(first_paint, 3), "idle_cpu_percent": round(idle_cpu, 2),
            "cache_entries": CACHE_ENTRIES, "cache_shown_s": round(shown - pressed, 3),
            "idle_seconds": idle_seconds, "interval_s": interval, "rss_bytes": rss,
            "load_average": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(),
            "targets": TARGETS,
            "met": {"first_paint_s": first_paint <= TARGETS["first_paint_s"],
                    "idle_cpu_percent": idle_cpu <= TARGETS["idle_cpu_percent"]}}


def residency_fallback(interval: float = 2.0, refreshes: int = 300) -> dict[str, Any]:
    """Residency of a 300 GiB sparse sidecar on the mincore fallback (kernels before 6.5): one
    unscheduled sample (what each refresh used to cost), then the console's schedule
    (`store.pagecache.schedule`, as `dsv4-console` sets it) over `refreshes` refreshes of
    `interval` seconds: real CPU time of the probes over the refreshes' (simulated) wall time."""
    from store import pagecache

    with tempfile.TemporaryDirectory(prefix="dsv4-console-bench-") as tmp:
        path = Path(tmp) / "dsv4-packed.r1.safetensors"
        with open(path, "wb") as f:
            f.truncate(SPARSE_GIB << 30)
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.thread_time()
            pagecache.residency(fd, method="mincore")
            one = time.thread_time() - t0
            now = [0.0]
            pagecache.schedule(pagecache.REFRESH_SHARE, clock=lambda: now[0])
            try:
                taken, c0 = set(), time.thread_time()
                for _ in range(refreshes):
                    taken.add(pagecache.residency(fd, method="mincore").sampled_at)
                    now[0] += interval
                cpu = time.thread_time() - c0
            finally:
                pagecache.schedule(None)
        finally:
            os.close(fd)
    percent = 100.0 * cpu / (refreshes * interval)
    return {"sparse_gib": SPARSE_GIB, "sample_s": round(one, 4), "unscheduled_percent": round(100 * one / interval, 2),
            "scheduled_percent": round(percent, 3), "samples": len(taken), "refreshes": refreshes,
            "interval_s": interval, "met": percent <= TARGETS["fallback_residency_percent"]}


def _cpu(ps: psutil.Process) -> float:
    t = ps.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _wait_for(fd: int, marker: bytes, timeout: float) -> float | None:
    seen = b""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return None
            seen = (seen + chunk)[-(1 << 16):]
            if marker in seen:
                return time.perf_counter()
    return None


def _drain(fd: int, stop: threading.Event) -> None:
    """Keep reading the terminal so the console never blocks on a full pty buffer."""
    while not stop.is_set():
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                os.read(fd, 65536)
            except OSError:
                return


def _table(r: dict[str, Any]) -> None:
    from bench.report import print_table

    rows = []
    s = r.get("with_services")
    if s:
        rows += [
            (f"idle CPU with {s['services']} services under load", f"{s['idle_cpu_percent']:.2f} % of one core",
             f"≤ {TARGETS['idle_cpu_percent']} %",
             "yes" if s["idle_cpu_percent"] <= TARGETS["idle_cpu_percent"] else "NO"),
            (f"a refresh with {s['services']} services (median · worst of 10)",
             f"{s['refresh_median_s']:.3f} · {s['refresh_max_s']:.3f} s", f"≤ {TARGETS['refresh_s']} s",
             "yes" if s["refresh_max_s"] <= TARGETS["refresh_s"] else "NO"),
        ]
    rows += [
        ("first paint", f"{r['first_paint_s']:.3f} s", f"≤ {TARGETS['first_paint_s']} s",
         "yes" if r["met"]["first_paint_s"] else "NO"),
        (f"idle CPU over {r['idle_seconds']:.0f} s (interval {r['interval_s']} s)",
         f"{r['idle_cpu_percent']:.2f} % of one core", f"≤ {TARGETS['idle_cpu_percent']} %",
         "yes" if r["met"]["idle_cpu_percent"] else "NO"),
        ("RSS while idle", f"{r['rss_bytes'] / 2**20:.1f} MiB", "", ""),
        (f"kernel cache view of {r['cache_entries']} entries: key to contents", f"{r['cache_shown_s']:.3f} s", "",
         ""),
    ]
    fl = r.get("fleet")
    if fl and "skipped" not in fl:
        rows += [
            (f"a fleet refresh, {fl['hosts']} hosts over ssh (median · worst of 10)",
             f"{fl['refresh_median_s']:.3f} · {fl['refresh_max_s']:.3f} s", f"≤ {TARGETS['fleet_refresh_s']} s",
             "yes" if fl["met"]["fleet_refresh_s"] else "NO"),
            (f"idle CPU with {fl['hosts']} hosts (console + its ssh clients and masters)",
             f"{fl['idle_cpu_percent']:.2f} % of one core", f"≤ {TARGETS['idle_cpu_percent']} %",
             "yes" if fl["met"]["idle_cpu_percent"] else "NO"),
            (f"  start to all {fl['hosts']} hosts reachable on screen", f"{fl['all_reachable_s']:.2f} s", "", ""),
        ]
    elif fl:
        rows.append((f"fleet of {fl['hosts']} hosts", fl["skipped"], "", ""))
    f = r.get("residency_fallback")
    if f:
        rows += [
            (f"residency, {f['sparse_gib']} GiB sparse sidecar, mincore fallback: one sample",
             f"{f['sample_s']:.3f} s ({f['unscheduled_percent']:.1f} % of a core if every refresh)", "", ""),
            (f"  on the console's schedule ({f['samples']} samples in {f['refreshes']} refreshes)",
             f"{f['scheduled_percent']:.2f} % of one core", f"≤ {TARGETS['fallback_residency_percent']} %",
             "yes" if f["met"] else "NO"),
        ]
    print_table("dsv4-console", ("measure", "value", "target", "met"), rows)
    print(f"host: {r['cpu_count']} cores, load average {' '.join(map(str, r['load_average']))} "
          "(another process's load shows up in first paint)")


def main(json_output: bool = False, idle_seconds: float = 30.0, fleet_hosts: int = FLEET_HOSTS) -> int:
    result = measure(idle_seconds)
    result["with_services"] = measure(idle_seconds, services=SERVICES)
    result["residency_fallback"] = residency_fallback()
    if fleet_hosts:
        result["fleet"] = measure_fleet(fleet_hosts, idle_seconds)
    if json_output:
        print(json.dumps(result, indent=2))
    else:
        _table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
