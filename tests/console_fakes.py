"""Fake snapshots for the console tests: fixed values, no filesystem, no clock."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from console.data.cache import CacheEntry, CacheSnapshot
from console.data.host import DeviceMemory, DeviceSnapshot, HostSnapshot
from console.data.records import LaunchRecord
from console.data.services import ServicesSnapshot, ServiceView, Serving
from console.data.snapshot import (
    OtherSidecar,
    ProgramsSnapshot,
    RegistrationSnapshot,
    SidecarsSnapshot,
    Snapshot,
)
from console.fleet.host import FileFeed
from console.fleet.local import LocalHost
from runtime.contract import Health, RankHealth
from runtime.launch.budget import Memory, launch_kv
from runtime.launch.history import Likeness
from runtime.launch.plan_report import KvPlan, PlanReport, ProgramPlan, RankKv, SidecarPlan
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from store.services import Service

NOW = 1_800_000_000.0
SPEC = LaunchSpec(Path("/models/tiny"), kernel_cache_dir=Path("/cache"), device="cpu", backend="eager", max_seq=64)


def device_snapshot(used: int = 8 << 30, total: int = 16 << 30, spec: LaunchSpec = SPEC, kind: str = "cpu",
                    devices: list[Memory] | None = None, slot_bytes: int = 1 << 20) -> DeviceSnapshot:
    """The Device pane's data for a host whose devices have these memories (default: a cpu host
    with `used` of `total` bytes in use), by the budget rule the plan applies."""
    devices = devices or [Memory(total, total - used, used, "cpu (host memory)")]
    kv = launch_kv(kind, devices, spec.ranks, slot_bytes, spec.memory_utilization, spec.max_slots, spec.max_seq)
    rows = tuple(DeviceMemory(name=m.name, total=m.total, used=m.used, free=m.free) for m in devices)
    return DeviceSnapshot(kind=kind, source="meminfo" if kind == "cpu" else "nvml",
                          utilization=spec.memory_utilization, devices=rows,
                          budgets=tuple(RankKv.of(b) for b in kv.per_rank), slot_bytes=slot_bytes, slots=kv.slots,
                          fits=kv.fits, max_slots=spec.max_slots, ranks=spec.ranks, warning=kv.missing)


def _program(program: str, fp: str, state: str, reason: str = "", entry: bool = True) -> ProgramPlan:
    return ProgramPlan(program=program, fingerprint=fp * 32, state=Outcome(state), reason=reason,
                       entry=f"/cache/v1/{program}/{fp * 32}" if entry else None)


# what makes the fakes' launches alike (runtime.launch.history.SETTINGS)
SETTINGS = {"model": "/models/tiny", "backend": "eager", "device": "cpu", "ranks": 1, "max_seq": 64,
            "sidecar": True, "sidecar_path": "/models/tiny/dsv4-packed.r1.safetensors"}


def record(seconds: float, outcome: str = "ok", weights: str = "MAP", pid: int = 4000, program: str = "HIT",
           **settings) -> dict:
    """A launch-history line of the fakes' settings (`settings` overrides some)."""
    return {**SETTINGS, **settings, "outcome": outcome, "pid": pid, "started": NOW - 600 + pid % 100, "phases": {
        "check": {"seconds": 0.05}, "programs": {"seconds": seconds, "counts": {program: 12},
                                                  "programs": {"layer.sliding.prefill": program}},
        "weights": {"seconds": 0.2, "path": weights}, "upload": {"seconds": 0.01, "zero_copy": True},
        "kv": {"seconds": 0.01, "slots": 4, "slot_bytes": 1 << 20, "max_seq": 64},
        "validate": {"seconds": 0.3, "health": "ok"}, "serve": {"seconds": 0.1, "url": "http://127.0.0.1:1234"}}}


def snapshot(*, starving: bool = False) -> Snapshot:
    programs = ProgramsSnapshot(root="/cache", entries=(
        _program("layer.sliding.prefill", "a1", "HIT"),
        _program("layer.sliding.decode", "b2", "STALE", "stale: torch is 2.12.0 here; this launch uses 2.13.0",
                 entry=False),
        _program("head", "c3", "CORRUPT", "program.pt2: sha256 mismatch"),
        _program("layer.csa.prefill", "d4", "MISS", "not cached", entry=False),
    ))
    wanted = SidecarPlan(path="/models/tiny/dsv4-packed.r1.safetensors", verdict="MAP", detail="valid and hot",
                         residency=0.75, residency_method="cachestat", size_bytes=8 << 20, sampled_at=NOW - 1,
                         expected_bytes=8 << 20, checkpoint_bytes=8 << 20, free_bytes=40 << 30, fits=True)
    sidecars = SidecarsSnapshot(model_dir="/models/tiny", wanted=wanted, others=(
        OtherSidecar(path="/models/tiny/dsv4-packed.r2.safetensors", size_bytes=8 << 20, ranks=2),))
    history = tuple(float(x) for x in (5, 10, 80, 40, 20, 15, 90, 60, 30, 10))
    host = HostSnapshot(cpu_percent=23.5, per_core=(20.0, 27.0), load=(0.5, 0.7, 0.9), mem_total=16 << 30,
                        mem_available=9 << 30, page_cache=4 << 30, disk_read_bps=12e6, disk_write_bps=3e6,
                        history={"cpu": history, "mem_available": history, "read": history, "write": history})
    device = device_snapshot(used=(16 << 30) if starving else (8 << 30))
    predicted = {"check": 0.05, "programs": 0.4, "weights": 0.2, "upload": 0.01, "kv": 0.01, "validate": 0.3}
    registration = RegistrationSnapshot(
        previous=LaunchRecord.of(record(2.5, pid=4101, program="MISS")),
        best_warm=LaunchRecord.of(record(0.4, pid=4002)),
        prediction={"check": "contract check", "programs": "HIT 1 MISS 1 STALE 1 CORRUPT 1", "weights": "MAP",
                    "upload": "zero-copy (cpu)", "validate": "decode check", "serve": "HTTP",
                    "kv": f"{device.slots} slots of 1.0 MiB" if device.slots else f"FAIL: {device.budgets[0].problem}"},
        basis="the plan of the next launch (runtime.launch.plan)", predicted=predicted)
    services = ServicesSnapshot((ServiceView(
        Service(4242, NOW - 3725, ("python", "-m", "console.cli", "serve", "/models/tiny"), "/models/tiny",
                "serving", "http://127.0.0.1:8000", "/state/services/output/serve-1.log",
                "/state/services/output/serve-1.events.jsonl", NOW - 3720, host="host-a", backend="export",
                max_seq=64),
        "ok", Health("ok", "/models/tiny", "tiny", 32, 20, 1, 12, 64, backend="export", device="cpu", host="host-a",
                     pid=4242, engine={"steps": 812, "mean_batch": 12.4, "acceptance": 0.61},
                     ranks=(RankHealth(0, 32, 20, 12, "host-a", 4242, "cpu", "serve", cpu_percent=97.0,
                                       rss_bytes=1300 << 20),)),
        serving=Serving(10.0, 3.5, 182.4, 0.031, 0.12, 0.019, None, 12, 1, 12, 32, 2, 0, 1, 52000,
                        {"tokens_s": (150.0, 170.0, 182.4)}, prompt_tokens_s=96.0, e2e_p50=2.1, e2e_p99=4.8,
                        queue_p50=0.002, queue_p99=0.004, above={"itl_p99": 5.12},
                        finished={"length": 30, "stop": 5}, source="10s")),),)
    kv = KvPlan(slot_bytes=1 << 20, slots=device.slots, fits=device.fits, max_slots=32, max_seq=64,
                per_rank=device.budgets, problem=device.budgets[0].problem if device.budgets else "")
    plan = PlanReport(model="/models/tiny", spec=SPEC, device="cpu", backend="eager", programs=programs.entries,
                      sidecar=wanted, kv=kv, predicted=predicted,
                      like=Likeness(SETTINGS, compiles=True, weights="MAP"))
    return Snapshot(ts=NOW, settings=SPEC, programs=programs, sidecars=sidecars, host=host, device=device,
                    registration=registration, services=services, plan=plan, cache=cache_snapshot())


def _entry(program: str, fp: str, state: str, reason: str, size: int, age: float, hits: int,
           purgeable: bool = False, **extra) -> CacheEntry:
    where = f"/cache/quarantine/{program}--{fp * 8}--1--abcd1234" if state == "quarantined" else \
        f"/cache/v1/{program}/{fp * 32}"
    return CacheEntry(program=program, fingerprint=fp * 32, state=state, reason=reason, size_bytes=size,
                      created=NOW - age, last_used=NOW - age / 2 if hits else NOW - age, hits=hits, path=where,
                      purgeable=purgeable, **extra)


def cache_snapshot() -> CacheSnapshot:
    """Every state an entry can be in, as the kernel cache view lists them."""
    entries = (
        _entry("layer.sliding.prefill", "a1", "current", "", 3 << 20, 7200, 12),
        _entry("layer.sliding.prefill", "e5", "other-layout", "layout's max_seq is 1024 here; this launch uses 64",
               3 << 20, 86400 * 3, 40, key_difference={"layout": '{"max_seq":1024} → {"max_seq":64}'}),
        _entry("layer.sliding.decode", "b2", "stale", "torch is 2.12.0 here; this launch uses 2.13.0", 2 << 20,
               86400 * 9, 3, True, key_difference={"torch": '"2.12.0" → "2.13.0"'}),
        _entry("head", "c3", "corrupt", "program.pt2 does not match its sha256", 1 << 20, 600, 0, True),
        _entry("layer.csa.prefill", "d4", "partial", "staging dir of pid 77 on host, age 2h (writer gone)",
               1 << 19, 7200, 0, True),
        _entry("embed", "f6", "quarantined", "quarantined: load failed: RuntimeError", 1 << 18, 3600, 0, True),
    )
    return CacheSnapshot(root="/cache", entries=entries, total_bytes=sum(e.size_bytes for e in entries),
                         limit_bytes=10 << 30, disk_free=50 << 30)




class FixedHost(LocalHost):
    """This host, its panes' snapshot a given one (`snapshot()`, which a test may override), its
    launch history `history()`'s; its commands and its logs are this host's own (a log is the file
    the snapshot's service record names)."""

    blocking = False  # snapshots applied on the UI thread: deterministic screens

    def __init__(self, snap: Snapshot | None = None):
        super().__init__()
        self.snap = snap or snapshot()
        self.calls = 0

    def history(self) -> list:
        return []

    def snapshot(self) -> Snapshot:
        self.calls += 1
        return self.snap

    def watch(self, spec, local_ranks=None) -> None:
        pass

    def ask(self, history: bool = False) -> None:
        self.latest = dataclasses.replace(self.snapshot(), history=tuple(self.history()) if history else ())
        self.received = time.monotonic()
        self.on_change()

    def log(self, label: str, *, pid=None, rank=None, node=None, follow: bool = True, previous: bool = False):
        from store.errors import UserError
        from store.logs import previous_of

        view = next(v for v in self.latest.services.services if pid is None or v.pid == pid)
        path = dict(view.logs())["service" if rank is None else f"rank {rank}"]
        if previous:  # as which_log: the record's previous_log, else the one kept beside the log
            path = (view.record.previous_log if rank is None and view.record.previous_log
                    else str(previous_of(Path(path))))
            if not Path(path).is_file():
                raise UserError(f"{label}: no previous run's log here")
        return FileFeed(label, path, self.name)


FakeCollectors = FixedHost  # the name the older tests know it by


def fake_app(**kw):
    """The console over a host of given snapshots: no worker, no watcher, no default checkpoint."""
    from console.tui.app import Dsv4Console

    return Dsv4Console(SPEC, host=kw.pop("collectors", None) or FixedHost(), watch=False,
                       create_default=False, interval=0, **kw)
