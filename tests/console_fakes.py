"""Fake collectors for the console tests: fixed snapshots, no filesystem, no clock."""

from __future__ import annotations

from pathlib import Path

from console.data.cache import CacheSnapshot
from console.data.collectors import (
    DeviceSnapshot,
    HostSnapshot,
    ProgramsSnapshot,
    RegistrationSnapshot,
    SidecarsSnapshot,
    Snapshot,
)
from console.data.services import ServicesSnapshot, ServiceView, Serving
from runtime.launch.budget import Memory, launch_kv
from runtime.launch.spec import LaunchSpec
from runtime.serve.contract import Health, RankHealth
from store.services import Service

NOW = 1_800_000_000.0
SPEC = LaunchSpec(Path("/models/tiny"), kernel_cache_dir=Path("/cache"), device="cpu", backend="eager", max_seq=64)


def device_snapshot(used: int = 8 << 30, total: int = 16 << 30, spec: LaunchSpec = SPEC, kind: str = "cpu",
                    devices: list[Memory] | None = None, slot_bytes: int = 1 << 20) -> DeviceSnapshot:
    """The Device pane's data for a host whose devices have these memories (default: a cpu host
    with `used` of `total` bytes in use), by the budget rule the plan applies."""
    devices = devices or [Memory(total, total - used, used, "cpu (host memory)")]
    kv = launch_kv(kind, devices, spec.ranks, slot_bytes, spec.memory_utilization, spec.max_slots, spec.max_seq)
    rows = tuple({"name": m.name, "total": m.total, "used": m.used, "free": m.free} for m in devices)
    return DeviceSnapshot(kind, "meminfo" if kind == "cpu" else "nvml", spec.memory_utilization, rows,
                          tuple(b.to_json() for b in kv.per_rank), slot_bytes, kv.slots, kv.fits, spec.max_slots,
                          spec.ranks, warning=kv.missing)


def _program(program: str, fp: str, state: str, reason: str = "", entry: bool = True) -> dict:
    return {"program": program, "fingerprint": fp * 32, "state": state, "reason": reason,
            "entry": f"/cache/v1/{program}/{fp * 32}" if entry else None}


# what makes the fakes' launches alike (runtime.launch.history.SETTINGS)
SETTINGS = {"model": "/models/tiny", "backend": "eager", "device": "cpu", "ranks": 1, "max_seq": 64,
            "sidecar": True, "sidecar_path": "/models/tiny/dsv4-packed.r1.safetensors"}


def record(seconds: float, outcome: str = "ok", weights: str = "MAP", pid: int = 4000, program: str = "HIT",
           **settings) -> dict:
    """A launch-history record of the fakes' settings (`settings` overrides some)."""
    return {**SETTINGS, **settings, "outcome": outcome, "pid": pid, "started": NOW - 600 + pid % 100, "phases": {
        "check": {"seconds": 0.05}, "programs": {"seconds": seconds, "counts": {program: 12},
                                                  "programs": {"layer.sliding.prefill": program}},
        "weights": {"seconds": 0.2, "path": weights}, "upload": {"seconds": 0.01, "zero_copy": True},
        "kv": {"seconds": 0.01, "slots": 4, "slot_bytes": 1 << 20, "max_seq": 64},
        "validate": {"seconds": 0.3, "health": "ok"}, "serve": {"seconds": 0.1, "url": "http://127.0.0.1:1234"}}}


def snapshot(*, starving: bool = False) -> Snapshot:
    programs = ProgramsSnapshot("/cache", (
        _program("layer.sliding.prefill", "a1", "HIT"),
        _program("layer.sliding.decode", "b2", "STALE", "stale: torch is 2.12.0 here; this launch uses 2.13.0",
                 entry=False),
        _program("head", "c3", "CORRUPT", "program.pt2: sha256 mismatch"),
        _program("layer.csa.prefill", "d4", "MISS", "not cached", entry=False),
    ))
    sidecars = SidecarsSnapshot("/models/tiny", ({
        "path": "/models/tiny/dsv4-packed.r1.safetensors", "verdict": "MAP", "reason": "", "detail": "valid and hot",
        "residency": 0.75, "residency_method": "cachestat", "size_bytes": 8 << 20, "sampled_at": NOW - 1,
        "expected_bytes": 8 << 20, "checkpoint_bytes": 8 << 20, "free_bytes": 40 << 30, "fits": True,
        "next_launch": "MAP", "wanted": True}, {
        "path": "/models/tiny/dsv4-packed.r2.safetensors", "verdict": "-", "reason": "", "detail": "",
        "residency": None, "size_bytes": 8 << 20, "sampled_at": None, "wanted": False,
        "next_launch": "not used (ranks 2)"}))
    history = tuple(float(x) for x in (5, 10, 80, 40, 20, 15, 90, 60, 30, 10))
    host = HostSnapshot(23.5, (20.0, 27.0), (0.5, 0.7, 0.9), 16 << 30, 9 << 30, 4 << 30, 12e6, 3e6,
                        {"cpu": history, "mem_available": history, "read": history, "write": history})
    device = device_snapshot(used=(16 << 30) if starving else (8 << 30))
    registration = RegistrationSnapshot(record(2.5, pid=4101, program="MISS"), record(0.4, pid=4002), {
        "check": "contract check", "programs": "HIT 1 MISS 1 STALE 1 CORRUPT 1", "weights": "MAP",
        "upload": "zero-copy (cpu)", "validate": "decode check", "serve": "HTTP",
        "kv": f"{device.slots} slots of 1.0 MiB" if device.slots else f"FAIL: {device.budgets[0]['problem']}"},
        "the plan of the next launch (runtime.launch.plan)", None,
        {"check": 0.05, "programs": 0.4, "weights": 0.2, "upload": 0.01, "kv": 0.01, "validate": 0.3})
    services = ServicesSnapshot((ServiceView(
        Service(4242, NOW - 3725, ("python", "-m", "console.cli", "serve", "/models/tiny"), "/models/tiny",
                "serving", "http://127.0.0.1:8000", "/state/services/output/serve-1.log",
                "/state/services/output/serve-1.events.jsonl", NOW - 3720, host="host-a", backend="export",
                max_seq=64),
        "ok", Health("ok", "/models/tiny", "tiny", 32, 20, 1, 12, 64, backend="export", device="cpu", host="host-a",
                     pid=4242, engine={"steps": 812, "mean_batch": 12.4, "acceptance": 0.61},
                     ranks=(RankHealth(0, 32, 20, 12, "host-a", 4242, "cpu", "serve"),)),
        serving=Serving(60.0, 3.5, 182.4, 0.031, 0.12, 0.019, 0.044, 12, 1, 12, 32, 2, 0, 1, 52000,
                        {"tokens_s": (150.0, 170.0, 182.4)})),),)
    plan = {"model": "/models/tiny", "programs": list(programs.entries), "sidecar": sidecars.sidecars[0],
            "kv": {"slots": device.slots, "fits": device.fits, "slot_bytes": 1 << 20, "max_slots": 32},
            "predicted": registration.predicted, "problems": [],
            "like": {"settings": SETTINGS, "compiles": True, "weights": "MAP"}}
    return Snapshot(NOW, {"model": "/models/tiny"}, programs, sidecars, host, device, registration, services,
                    plan, cache_snapshot())


def _entry(program: str, fp: str, state: str, reason: str, size: int, age: float, hits: int,
           purgeable: bool = False, **extra) -> dict:
    where = f"/cache/quarantine/{program}--{fp * 8}--1--abcd1234" if state == "quarantined" else \
        f"/cache/v1/{program}/{fp * 32}"
    return {"program": program, "fingerprint": fp * 32, "state": state, "reason": reason, "size_bytes": size,
            "created": NOW - age, "last_used": NOW - age / 2 if hits else NOW - age, "hits": hits, "path": where,
            "busy": False, "purgeable": purgeable, **extra}


def cache_snapshot() -> CacheSnapshot:
    """Every state an entry can be in, as the kernel cache view lists them."""
    entries = (
        _entry("layer.sliding.prefill", "a1", "current", "", 3 << 20, 7200, 12),
        _entry("layer.sliding.prefill", "e5", "other-layout", "layout's max_seq is 1024 here; this launch uses 64",
               3 << 20, 86400 * 3, 40, **{"key difference": {"layout": '{"max_seq":1024} → {"max_seq":64}'}}),
        _entry("layer.sliding.decode", "b2", "stale", "torch is 2.12.0 here; this launch uses 2.13.0", 2 << 20,
               86400 * 9, 3, True, **{"key difference": {"torch": '"2.12.0" → "2.13.0"'}}),
        _entry("head", "c3", "corrupt", "program.pt2 does not match its sha256", 1 << 20, 600, 0, True),
        _entry("layer.csa.prefill", "d4", "partial", "staging dir of pid 77 on host, age 2h (writer gone)",
               1 << 19, 7200, 0, True),
        _entry("embed", "f6", "quarantined", "quarantined: load failed: RuntimeError", 1 << 18, 3600, 0, True),
    )
    return CacheSnapshot("/cache", entries, sum(e["size_bytes"] for e in entries), 10 << 30, 50 << 30)


class FakeCollectors:
    device_kind = "cpu"
    inline = True  # snapshots applied on the UI thread: deterministic screens

    def __init__(self, snap: Snapshot | None = None):
        self.snap = snap or snapshot()
        self.calls = 0

    def history(self) -> list:
        return []

    def snapshot(self) -> Snapshot:
        self.calls += 1
        return self.snap


def fake_app(**kw):
    """The console over fake collectors: no worker, no watcher, no default checkpoint."""
    from console.tui.app import Dsv4Console

    return Dsv4Console(SPEC, collectors=kw.pop("collectors", FakeCollectors()), watch=False,
                       create_default=False, interval=0, **kw)
