"""`dsv4 bench sidecar`: what a prepacked sidecar saves at launch, side by side, on one file.

On one synthetic checkpoint (the preset's embedded default, made on first use) and one sidecar
prepacked from it into a temp dir:

- packing from the checkpoint, shards hot (the no-sidecar path, `pack_in_memory`): the baseline;
- `safetensors.torch.load_file` of the sidecar + the same touch (safetensors 0.8 maps the file
  privately, copy-on-write, and reads lazily: without the touch it would time nothing);
- our hot path: judge + map (`open_prepacked`) + touch one byte per 4 KiB page through the views;
- `cat FILE > /dev/null` from the page cache: the ceiling for reading those bytes at all;
- the cold path per policy (evicted first): reject (verdict, then repack), read (map, read-ahead,
  touch), auto (whichever the remembered read throughput predicts faster);
- residency probes of the sidecar and of a 1 GiB file of real bytes: cachestat, mincore,
  util-linux `fincore` (a subprocess, as an operator would run it);
- `dsv4 prepack` in a subprocess: wall time and peak RSS against the largest packed layer.

Times are the best of a few runs for the quick rows and one run for packing and prepack. The
temp dir (sidecar and 1 GiB file) is deleted at the end.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
RUNS = 5  # best-of runs for the quick rows
TARGETS = {
    "map_vs_pack": 5.0,  # hot map + touch at least this many times faster than packing
    "map_vs_cat": 1.5,  # and within this factor of `cat FILE > /dev/null` from the page cache
    "probe_ms": 1.0,  # cachestat of a 1 GiB file
    "probe_vs_fincore": 10.0,
    "rss_layers": 3.0,  # prepack peak RSS <= 3 x largest packed layer + 0.5 GiB
    "rss_slack": 0.5 * GIB,
    "verify_vs_cat": 2.0,  # verifying every chunk of a hot sidecar vs `cat` from the page cache
    "warm_verify": 1.3,  # warm with verify vs warm without
}


@dataclass
class Row:
    kind: str  # "measure" | "target" | "context"
    name: str
    seconds: float | None = None
    vs_packing: float | None = None  # packing seconds / these seconds (>1: faster)
    bytes: int | None = None
    note: str = ""
    measured: str = ""  # targets: the measured value, in words
    met: bool | None = None


def _best(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _median(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touch_pages(tensors: dict) -> int:
    """Sum one byte of every 4 KiB of every tensor (faults the mapping in, copies nothing)."""
    import torch

    total = 0
    for t in tensors.values():
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def largest_layer_bytes(plan) -> tuple[str, int]:
    """The packing group (top, a layer, an MTP layer) whose packed slices are largest."""
    from store.sidecar import DTYPE_SIZES

    sizes = {}
    for group, params in plan.groups:
        n = 0
        for p in params:
            slot = plan.slots[p.name]
            for name in slot.names:
                t = plan.tensors[name]
                n += math.prod(t.shape[len(slot.index) :]) * DTYPE_SIZES[t.dtype]
        sizes[group] = n
    group = max(sizes, key=sizes.__getitem__)
    return group, sizes[group]


@dataclass(frozen=True)
class ChildUsage:
    seconds: float
    max_rss: int  # ru_maxrss: anonymous and file-backed pages together
    anon_peak: int  # sampled from /proc/PID/status every SAMPLE_S (may miss a short spike)
    file_peak: int  # mapped file pages (checkpoint shards read through mmap): page cache


SAMPLE_S = 0.02


def _status_kib(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {
                k: int(v.split()[0])
                for k, _, v in (line.partition(":") for line in f)
                if k in ("RssAnon", "RssFile")
            }
    except (OSError, ValueError):
        return {}


def _run_measured(argv: list[str]) -> ChildUsage:
    """Run a child to completion: wall time, ru_maxrss, and sampled anon/file RSS peaks."""
    import threading

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peaks = {"RssAnon": 0, "RssFile": 0}
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                for k, v in _status_kib(proc.pid).items():
                    peaks[k] = max(peaks[k], v)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"{' '.join(argv[-4:])} exited {proc.returncode}: {tail}")
    return ChildUsage(
        seconds, usage.ru_maxrss * 1024, peaks["RssAnon"] * 1024, peaks["RssFile"] * 1024
    )


def _fincore(path: Path) -> None:
    subprocess.run(
        ["fincore", "--bytes", "--noheadings", str(path)], check=True, stdout=subprocess.DEVNULL
    )


def _cat(path: Path) -> None:
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", str(path)], check=True, stdout=null)


def _probe_rows(label: str, path: Path, have_fincore: bool) -> tuple[list[Row], dict[str, float]]:
    from store import pagecache

    rows, times = [], {}
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for method, runs in (("cachestat", 50), ("mincore", 10)):
            try:
                res = pagecache.residency(fd, method=method)
            except OSError as e:
                rows.append(Row("measure", f"probe {label}: {method}", note=f"unavailable ({e})"))
                continue
            s = _median(lambda m=method: pagecache.residency(fd, method=m), runs)
            times[method] = s
            note = f"median of {runs}; {res.fraction:.1%} resident"
            rows.append(Row("measure", f"probe {label}: {method}", s, bytes=size, note=note))
    finally:
        os.close(fd)
    if have_fincore:
        s = _median(lambda: _fincore(path), 5)
        times["fincore"] = s
        rows.append(
            Row(
                "measure",
                f"probe {label}: fincore",
                s,
                bytes=size,
                note="median of 5; util-linux subprocess",
            )
        )
    else:
        rows.append(
            Row("measure", f"probe {label}: fincore", note="skipped: fincore not installed")
        )
    return rows, times


def _write_real_bytes(path: Path, size: int) -> None:
    """A file of real (non-sparse) bytes: sparse holes are never in the page cache."""
    chunk = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)


def run(preset: str = "small", log: Callable[[str], None] = print) -> list[Row]:
    from runtime import pack
    from runtime.prepack import open_prepacked, pack_plan
    from runtime.synth import ensure_default_model
    from store import pagecache, sidecar
    from store.checkpoint import Checkpoint
    from store.units import format_size

    model, created = ensure_default_model(preset)
    log(f"checkpoint: {model}" + (" (synthesized now)" if created else " (reused)"))
    plan = pack_plan(model, 1)
    layer_group, layer_bytes = largest_layer_bytes(plan)
    have_fincore = shutil.which("fincore") is not None
    rows: list[Row] = []
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="dsv4-bench-sidecar-"))
    try:
        sidecar_path = tmp / sidecar.file_name(1)  # the one place the name is built

        log("prepack (subprocess) …")
        base = _run_measured([sys.executable, "-c", "import runtime.prepack"])
        pre = _run_measured(
            [sys.executable, "-m", "console.cli", "prepack", str(model), "--out", str(sidecar_path)]
        )
        size = sidecar_path.stat().st_size

        for shard in Checkpoint.open(model).shard_paths():
            pagecache.warm(shard, remember=False)
        pagecache.warm(sidecar_path, remember=False)

        log("packing from the checkpoint …")
        with Checkpoint.open(model) as ckpt:
            pack_s, packed = _best(lambda: pack.pack_in_memory(ckpt, plan), 1)
        del packed

        def ratio(s: float | None) -> float | None:
            return pack_s / s if s else None

        def measure(name: str, s: float, note: str = "", nbytes: int | None = size) -> float:
            rows.append(Row("measure", name, s, ratio(s), nbytes, note))
            return s

        measure(
            "pack from checkpoint (no sidecar; baseline)",
            pack_s,
            "pack_in_memory, shards in page cache, 1 run",
            None,
        )
        measure(
            "dsv4 prepack (subprocess, writes the sidecar)",
            pre.seconds,
            f"peak RSS {format_size(pre.max_rss)}: anon ≤ {format_size(pre.anon_peak)}, "
            f"mapped shards ≤ {format_size(pre.file_peak)} (sampled); python + torch import "
            f"alone {format_size(base.max_rss)}",
        )

        log("safetensors load_file …")
        from safetensors.torch import load_file

        def load_and_touch() -> float:
            t0 = time.perf_counter()
            loaded = load_file(sidecar_path)
            opened = time.perf_counter() - t0
            touch_pages(loaded)
            return opened

        load_s, opened_s = _best(load_and_touch, RUNS)
        measure(
            "safetensors load_file + touch every page",
            load_s,
            f"best of {RUNS}; load_file {_fmt_s(opened_s)} (a private lazy mapping), "
            f"touch {_fmt_s(load_s - opened_s)}",
        )

        log("hot map + touch …")

        def map_and_touch() -> tuple[float, str]:
            t0 = time.perf_counter()
            verdict, mapped = open_prepacked(model, 1, sidecar_path)
            opened = time.perf_counter() - t0
            if mapped is None:
                raise RuntimeError(f"hot sidecar not mapped: {verdict.line()}")
            with mapped:
                touch_pages(mapped.tensors)
            return opened, verdict.detail

        map_s, (opened_s, detail) = _best(map_and_touch, RUNS)
        measure(
            "our hot path: judge + map + touch every page",
            map_s,
            f"best of {RUNS}; judge + map {_fmt_s(opened_s)}, touch {_fmt_s(map_s - opened_s)}; "
            f"{detail}",
        )

        cat_s, _ = _best(lambda: _cat(sidecar_path), RUNS)
        measure("cat FILE > /dev/null (page cache; ceiling)", cat_s, f"best of {RUNS}, incl. spawn")
        rows += _verify_rows(sidecar_path, cat_s, measure)

        log("cold paths …")
        for policy in ("reject", "read", "auto"):
            after = pagecache.evict(sidecar_path)
            t0 = time.perf_counter()
            verdict, mapped = open_prepacked(model, 1, sidecar_path, cold_policy=policy)
            if mapped is not None:
                with mapped:
                    touch_pages(mapped.tensors)
                s = time.perf_counter() - t0
                what = "MAP: read-ahead + touch"
            else:
                judged = time.perf_counter() - t0
                s = judged + pack_s
                what = f"REPACK {verdict.reason} in {_fmt_s(judged)}, then packing (baseline)"
            if verdict.predicted_read_s is not None:
                what += (
                    f"; predicted read {verdict.predicted_read_s:.1f} s vs repack "
                    f"{verdict.predicted_pack_s:.1f} s"
                )
            measure(f"cold, policy {policy}", s, f"evicted to {after.fraction:.0%}; {what}")

        pagecache.warm(sidecar_path, remember=False)
        log("residency probes …")
        probe_rows, _ = _probe_rows(f"sidecar {format_size(size)}", sidecar_path, have_fincore)
        rows += probe_rows
        big = tmp / "probe-1GiB.bin"
        log("writing a 1 GiB file of real bytes for the probe …")
        _write_real_bytes(big, GIB)
        big_rows, probe = _probe_rows("1 GiB, as written", big, have_fincore)
        rows += big_rows
        # A sidecar is hot because it was read; page-cache folios from reads are smaller than
        # from large writes, and cachestat's cost grows with their count: probe that state too.
        pagecache.evict(big)
        pagecache.warm(big, remember=False)
        read_rows, read_probe = _probe_rows("1 GiB, read back", big, have_fincore)
        rows += read_rows
        big.unlink()
        probes = [probe, read_probe]

        import safetensors

        context = (
            f"{os.cpu_count()} CPUs, kernel {os.uname().release}, safetensors "
            f"{safetensors.__version__}; 1-min load average {load_start:.1f} at start, "
            f"{os.getloadavg()[0]:.1f} at end"
        )
        rows.append(Row("context", "host", note=context))
        rows += _targets(pack_s, map_s, cat_s, probes, pre.max_rss, layer_group, layer_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _verify_rows(path: Path, cat_s: float, measure: Callable[..., float]) -> list[Row]:
    """Checking the data: verify of the hot sidecar vs cat, and warm with vs without verify."""
    from store import pagecache
    from store.sidecar import checksum

    def verify() -> None:
        result = checksum.verify_file(path)
        if not result.ok:
            raise RuntimeError(f"fresh sidecar does not verify: {result.detail}")

    def warm(with_verify: bool) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            check = checksum.verifier(fd) if with_verify else None
        finally:
            os.close(fd)
        pagecache.warm(path, remember=False, sink=check.feed if check else None, chunk=checksum.READ_BYTES)
        if check is not None and not check.result().ok:
            raise RuntimeError("fresh sidecar does not verify while warming")

    verify_s, _ = _best(verify, RUNS)
    measure("verify every data chunk (hot, in-process)", verify_s,
            f"best of {RUNS}; xxh3-64 per {checksum.CHUNK_BYTES >> 20} MiB chunk, "
            f"pread {checksum.READ_BYTES >> 20} MiB")
    warm_s, _ = _best(lambda: warm(False), RUNS)
    measure("warm (hot, in-process, no verify)", warm_s, f"best of {RUNS}; same read size")
    warmv_s, _ = _best(lambda: warm(True), RUNS)
    measure("warm + verify (hot, in-process)", warmv_s, f"best of {RUNS}")
    t = TARGETS
    return [
        Row("target", f"verify of a hot sidecar within {t['verify_vs_cat']:g}x of cat",
            measured=f"{verify_s / cat_s:.2f}x cat", met=verify_s <= t["verify_vs_cat"] * cat_s),
        Row("target", f"warm with verify within {t['warm_verify']:g}x of warm without",
            measured=f"{warmv_s / warm_s:.2f}x", met=warmv_s <= t["warm_verify"] * warm_s),
    ]  # fmt: skip


def _targets(pack_s, map_s, cat_s, probes, rss, layer_group, layer_bytes) -> list[Row]:
    """Each target and whether it is met; probe targets take the worse of the 1 GiB states."""
    from store.units import format_size

    t = TARGETS
    out = [
        Row(
            "target",
            f"hot map + touch >= {t['map_vs_pack']:g}x faster than packing",
            measured=f"{pack_s / map_s:.1f}x",
            met=pack_s / map_s >= t["map_vs_pack"],
        ),
        Row(
            "target",
            f"hot map + touch within {t['map_vs_cat']:g}x of cat from page cache",
            measured=f"{map_s / cat_s:.2f}x cat",
            met=map_s <= t["map_vs_cat"] * cat_s,
        ),
    ]
    cs = [p["cachestat"] for p in probes if "cachestat" in p]
    name = f"cachestat probe of 1 GiB <= {t['probe_ms']:g} ms"
    if cs:
        shown = " / ".join(f"{c * 1e3:.3f}" for c in cs)
        met = max(cs) * 1e3 <= t["probe_ms"]
        out.append(Row("target", name, measured=f"{shown} ms (written / read back)", met=met))
    else:
        out.append(Row("target", name, measured="cachestat unavailable on this kernel"))
    ratios = [p["fincore"] / p["cachestat"] for p in probes if {"cachestat", "fincore"} <= set(p)]
    name = f"cachestat >= {t['probe_vs_fincore']:g}x faster than fincore"
    if ratios:
        shown = " / ".join(f"{r:.0f}x" for r in ratios)
        met = min(ratios) >= t["probe_vs_fincore"]
        out.append(Row("target", name, measured=f"{shown} (written / read back)", met=met))
    else:
        out.append(Row("target", name, measured="not measurable (cachestat or fincore missing)"))
    bound = t["rss_layers"] * layer_bytes + t["rss_slack"]
    out.append(
        Row(
            "target",
            f"prepack peak RSS <= {t['rss_layers']:g} x largest layer + 0.5 GiB",
            measured=f"{format_size(rss)} vs bound {format_size(bound)} "
            f"(largest layer {layer_group}: {format_size(layer_bytes)})",
            met=rss <= bound,
        )
    )
    return out


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s < 0.1 else f"{s:.2f} s"


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    if r == 1.0:
        return "baseline"
    return f"{r:.1f}x faster" if r >= 1 else f"{1 / r:.1f}x slower"


def main(preset: str = "small", json_output: bool = False) -> int:
    from bench.report import print_json, print_table
    from store.units import format_size

    rows = run(preset, log=lambda m: print(m, file=sys.stderr))
    if json_output:
        print_json([asdict(r) for r in rows])
        return 0
    measures = [r for r in rows if r.kind == "measure"]
    print_table(
        f"sidecar bench ({preset} preset)",
        ("path", "time", "vs packing", "bytes", "note"),
        [
            (
                r.name,
                _fmt_s(r.seconds),
                _fmt_ratio(r.vs_packing),
                "-" if r.bytes is None else format_size(r.bytes),
                r.note,
            )
            for r in measures
        ],
    )
    for r in rows:
        if r.kind == "context":
            print(f"{r.name}: {r.note}")
    targets = [r for r in rows if r.kind == "target"]
    met = {True: "yes", False: "NO", None: "n/a"}
    print_table(
        "targets",
        ("target", "measured", "met"),
        [(r.name, r.measured, met[r.met]) for r in targets],
    )
    return 0
