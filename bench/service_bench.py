"""`dsv4 bench service`: 64 concurrent clients against `dsv4 serve` of the tiny model (eager).

Starts a server on loopback, sends ROUNDS rounds of 64 concurrent completions (max_tokens 4)
and prints p50/p99 latency, throughput and the server's RSS before/after. Reported, never
asserted (tests/reliability asserts correctness and the RSS bound).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CLIENTS, ROUNDS, MAX_TOKENS = 64, 4, 4


def _start(model_dir: Path, events: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(model_dir), "--backend", "eager",
                             "--device", "cpu", "--port", "0", "--max-seq", "64", "--events", str(events)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if events.exists():
            for line in events.read_text().splitlines():
                e = json.loads(line)
                if e.get("phase") == "serve" and e.get("kind") == "end":
                    return proc, e["detail"]["url"]
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("dsv4 bench service: the server did not start")


def main(json_output: bool = False) -> int:
    import httpx
    import psutil

    from runtime.synth import synthesize

    with tempfile.TemporaryDirectory(prefix="dsv4-bench-service-") as tmp:
        model = synthesize("tiny", Path(tmp) / "ckpt", seed=0)
        proc, url = _start(model, Path(tmp) / "events.jsonl")
        try:
            rss0 = psutil.Process(proc.pid).memory_info().rss

            def one(i: int) -> tuple[float, bool]:
                t0 = time.perf_counter()
                with httpx.Client(timeout=300) as c:
                    r = c.post(f"{url}/v1/completions", json={"prompt": [1 + i % 7, 2, 3], "max_tokens": MAX_TOKENS})
                return time.perf_counter() - t0, r.status_code == 200

            lat, ok = [], 0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(CLIENTS) as pool:
                for _ in range(ROUNDS):
                    for s, good in pool.map(one, range(CLIENTS)):
                        lat.append(s)
                        ok += good
            wall = time.perf_counter() - t0
            rss1 = psutil.Process(proc.pid).memory_info().rss
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    lat.sort()
    row = {
        "clients": CLIENTS, "requests": len(lat), "ok": ok, "max_tokens": MAX_TOKENS,
        "p50_ms": round(statistics.median(lat) * 1000, 1), "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1000, 1),
        "requests_per_s": round(len(lat) / wall, 1), "rss_before_mib": rss0 >> 20, "rss_after_mib": rss1 >> 20,
        "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
    }  # fmt: skip
    if json_output:
        print(json.dumps(row))
    else:
        width = max(len(k) for k in row)
        for k, v in row.items():
            print(f"{k:<{width}}  {v}")
    return 0 if ok == len(lat) else 1
