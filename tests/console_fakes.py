"""Fake collectors for the console tests: fixed snapshots, no filesystem, no clock."""

from __future__ import annotations

from console.collect_services import ServicesSnapshot
from console.collectors import (
    DeviceSnapshot,
    HostSnapshot,
    ProgramsSnapshot,
    RegistrationSnapshot,
    SidecarsSnapshot,
    Snapshot,
)

NOW = 1_800_000_000.0


def _program(program: str, fp: str, state: str, reason: str = "", entry: bool = True) -> dict:
    return {"program": program, "fingerprint": fp * 32, "state": state, "reason": reason,
            "entry": f"/cache/v1/{program}/{fp * 32}" if entry else None}


def _record(seconds: float, outcome: str = "ok", weights: str = "MAP", pid: int = 4000) -> dict:
    return {"model": "/models/tiny", "outcome": outcome, "pid": pid, "started": NOW - 600 + pid % 100, "phases": {
        "check": {"seconds": 0.05}, "programs": {"seconds": seconds, "counts": {"HIT": 12},
                                                  "programs": {"layer.sliding.prefill": "HIT"}},
        "weights": {"seconds": 0.2, "path": weights}, "upload": {"seconds": 0.01, "zero_copy": True},
        "kv": {"seconds": 0.01, "slots": 4, "slot_bytes": 1 << 20, "max_seq": 64},
        "validate": {"seconds": 0.3, "health": "ok"}, "serve": {"seconds": 0.1, "url": "http://127.0.0.1:1234"}}}


def snapshot(*, starving: bool = False) -> Snapshot:
    programs = ProgramsSnapshot("/cache", (
        _program("layer.sliding.prefill", "a1", "HIT"),
        _program("layer.sliding.decode", "b2", "STALE", "torch 2.12.0 → 2.13.0", entry=False),
        _program("head", "c3", "CORRUPT", "program.pt2: sha256 mismatch"),
        _program("layer.csa.prefill", "d4", "MISS", "not cached", entry=False),
    ))
    sidecars = SidecarsSnapshot("/models/tiny", ({
        "path": "/models/tiny/dsv4-packed.r1.safetensors", "verdict": "MAP", "reason": "", "detail": "valid and hot",
        "residency": 0.75, "residency_method": "cachestat", "size_bytes": 8 << 20, "sampled_at": NOW - 1,
        "next_launch": "MAP", "wanted": True}, {
        "path": "/models/tiny/dsv4-packed.r2.safetensors", "verdict": "-", "reason": "", "detail": "",
        "residency": None, "size_bytes": 8 << 20, "sampled_at": None, "wanted": False,
        "next_launch": "not used (ranks 2)"}))
    history = tuple(float(x) for x in (5, 10, 80, 40, 20, 15, 90, 60, 30, 10))
    host = HostSnapshot(23.5, (20.0, 27.0), (0.5, 0.7, 0.9), 16 << 30, 9 << 30, 4 << 30, 12e6, 3e6,
                        {"cpu": history, "mem_available": history, "read": history, "write": history})
    budget = -(1 << 30) if starving else (6 << 30)
    warning = "residual usage leaves no KV budget (total × 0.9 − used ≤ 0): the launch would fail at kv" if starving else ""
    device = DeviceSnapshot("cpu", "meminfo", 0.9, ({
        "name": "cpu (host memory)", "total": 16 << 30, "used": 8 << 30, "free": 8 << 30, "budget": budget,
        "slots": None if starving else 6144, "warning": warning},), 1 << 20)
    registration = RegistrationSnapshot(_record(2.5, weights="REPACK", pid=4101), _record(0.4, pid=4002), {
        "check": "contract check", "programs": "HIT 1 MISS 1 STALE 1 CORRUPT 1", "weights": "MAP",
        "upload": "zero-copy (cpu)", "kv": "4 slots of 1.0 MiB", "validate": "decode check", "serve": "HTTP"},
        "the plan of the next launch (runtime.plan)", None,
        {"check": 0.05, "programs": 0.4, "weights": 0.2, "upload": 0.01, "kv": 0.01, "validate": 0.3})
    services = ServicesSnapshot(({
        "pid": 4242, "create_time": NOW - 3725, "cmdline": ["python", "-m", "console.cli", "serve", "/models/tiny"],
        "model": "/models/tiny", "state": "serving", "url": "http://127.0.0.1:8000", "started": NOW - 3720,
        "log": "/state/services/output/serve-1.log", "events": "/state/services/output/serve-1.events.jsonl",
        "v": 1, "from_console": True, "health": "ok",
        "engine": {"steps": 812, "mean_batch": 12.4, "acceptance": 0.61}},))
    plan = {"model": "/models/tiny", "programs": list(programs.entries), "sidecar": sidecars.sidecars[0],
            "kv": {"slots": 4, "slot_bytes": 1 << 20}, "predicted": registration.predicted, "problems": []}
    return Snapshot(NOW, {"model_dir": "/models/tiny"}, programs, sidecars, host, device, registration, services,
                    plan)


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
    from pathlib import Path

    from console.app import Dsv4Console
    from console.collectors import Settings

    settings = Settings(Path("/models/tiny"), Path("/cache"), device="cpu", backend="eager", max_seq=64)
    return Dsv4Console(settings, collectors=kw.pop("collectors", FakeCollectors()), watch=False,
                       create_default=False, interval=0, **kw)
