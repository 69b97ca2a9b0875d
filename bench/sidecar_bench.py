"""`dsv4 bench sidecar`: what a prepacked sidecar saves at launch, side by side, on one file.

On one synthetic checkpoint (the preset's embedded default, made on first use) and one sidecar
prepacked from it into a temp dir:

- packing from the checkpoint, shards hot (the no-sidecar path, `pack_in_memory`): the baseline;
- `safetensors.torch.load_file` of the sidecar + the same touch (safetensors 0.8 maps the file
  privately, copy-on-write, and reads lazily: without the touch it would time nothing);
- our hot path: judge + map (`open_prepacked`, handed the layout as registration hands it) + touch
  one byte per 4 KiB page through the views;
- `cat FILE > /dev/null` from the page cache: the ceiling for reading those bytes at all;
- the cold path per policy (evicted first): reject (verdict, then repack), read (map, read-ahead,
  touch), auto (whichever the remembered read throughput predicts faster);
- residency probes of the sidecar and of a 1 GiB file of real bytes: cachestat, mincore,
  util-linux `fincore` (a subprocess, as an operator would run it);
- `dsv4 prepack` in a subprocess: wall time and peak RSS against the largest packed layer.

Times are the best of a few runs for the quick rows and one run for packing and prepack. The
temp dir (sidecar and 1 GiB file) is deleted at the end. The measuring tools live in
`bench.sidecar_measure`, the targets in `bench.sidecar_targets`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.sidecar_measure import (
    GIB,
    RUNS,
    Row,
    best,
    cat,
    largest_layer_bytes,
    probe_rows,
    run_measured,
    touch_pages,
    write_real_bytes,
)
from bench.sidecar_targets import target_rows, verify_rows


def run(preset: str = "small", log: Callable[[str], None] = print) -> list[Row]:
    from runtime.synth.checkpoint import ensure_default_model
    from runtime.weights import pack
    from runtime.weights.prepack import open_prepacked, packed_layout
    from store import pagecache, sidecar
    from store.checkpoint import Checkpoint
    from store.units import format_size

    model, created = ensure_default_model(preset)
    log(f"checkpoint: {model}" + (" (synthesized now)" if created else " (reused)"))
    layout = packed_layout(model, 1)
    layer_group, layer_bytes = largest_layer_bytes(layout)
    have_fincore = shutil.which("fincore") is not None
    rows: list[Row] = []
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="dsv4-bench-sidecar-"))
    try:
        sidecar_path = tmp / sidecar.file_name(1)  # the one place the name is built

        log("prepack (subprocess) …")
        base = run_measured([sys.executable, "-c", "import runtime.weights.prepack"])
        pre = run_measured(
            [sys.executable, "-m", "console.cli", "prepack", str(model), "--out", str(sidecar_path)]
        )
        size = sidecar_path.stat().st_size

        for shard in Checkpoint.open(model).shard_paths():
            pagecache.warm(shard, remember=False)
        pagecache.warm(sidecar_path, remember=False)

        log("packing from the checkpoint …")
        with Checkpoint.open(model) as ckpt:
            pack_s, packed = best(lambda: pack.pack_in_memory(ckpt, layout), 1)
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

        load_s, opened_s = best(load_and_touch, RUNS)
        measure(
            "safetensors load_file + touch every page",
            load_s,
            f"best of {RUNS}; load_file {_fmt_s(opened_s)} (a private lazy mapping), "
            f"touch {_fmt_s(load_s - opened_s)}",
        )

        log("hot map + touch …")

        def map_and_touch() -> tuple[float, str]:
            t0 = time.perf_counter()
            # the layout comes built, as registration's plan hands it over (it packs or maps by it)
            verdict, mapped = open_prepacked(model, 1, sidecar_path, packed=layout)
            opened = time.perf_counter() - t0
            if mapped is None:
                raise RuntimeError(f"hot sidecar not mapped: {verdict.line()}")
            with mapped:
                touch_pages(mapped.tensors)
            return opened, verdict.detail

        map_s, (opened_s, detail) = best(map_and_touch, RUNS)
        measure(
            "our hot path: judge + map + touch every page",
            map_s,
            f"best of {RUNS}; judge + map {_fmt_s(opened_s)}, touch {_fmt_s(map_s - opened_s)}; "
            f"{detail}",
        )

        cat_s, _ = best(lambda: cat(sidecar_path), RUNS)
        measure("cat FILE > /dev/null (page cache; ceiling)", cat_s, f"best of {RUNS}, incl. spawn")
        rows += verify_rows(sidecar_path, cat_s, measure)

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
        sidecar_rows, _ = probe_rows(f"sidecar {format_size(size)}", sidecar_path, have_fincore)
        rows += sidecar_rows
        big = tmp / "probe-1GiB.bin"
        log("writing a 1 GiB file of real bytes for the probe …")
        write_real_bytes(big, GIB)
        big_rows, probe = probe_rows("1 GiB, as written", big, have_fincore)
        rows += big_rows
        # A sidecar is hot because it was read; page-cache folios from reads are smaller than
        # from large writes, and cachestat's cost grows with their count: probe that state too.
        pagecache.evict(big)
        pagecache.warm(big, remember=False)
        read_rows, read_probe = probe_rows("1 GiB, read back", big, have_fincore)
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
        rows += target_rows(pack_s, map_s, cat_s, probes, pre.max_rss, layer_group, layer_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


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
        print_json({"preset": preset, **{r.key: r.ratio for r in rows if r.key}, "rows": [asdict(r) for r in rows]})
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
