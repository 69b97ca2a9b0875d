"""Collectors: plain Python that returns immutable snapshots of what the console shows.

Nothing here imports torch or opens a device context (device memory comes from meminfo,
NVML or `npu-smi`). Panes only render these snapshots, `--once --json` prints them, and tests
feed fake ones. Every collector turns its own failure into an `error` string on its snapshot:
one unreadable directory never blanks the console.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from console.collect_services import ServicesSnapshot, collect_services
from runtime.events import PHASES
from store import kernel_cache as kc
from store import sidecar as sc
from store.paths import data_dir, kernel_cache_dir
from store.units import format_size

HISTORY_POINTS = 60  # sparkline length: two minutes at the default interval
SCHEMA_VERSION = 1


def default_model_dir() -> Path:
    """Where the embedded default checkpoint lives, without importing torch.

    The twin of `runtime.synth.default_model_dir()` (which imports torch); a test pins both
    to the same path."""
    preset = os.environ.get("DSV4_DEFAULT_PRESET", "small")
    return data_dir() / "models" / f"{preset}-seed0"


def default_preset() -> str:
    return os.environ.get("DSV4_DEFAULT_PRESET", "small")


@dataclass(frozen=True)
class Settings:
    """What the console was started with (the CLI flags, resolved)."""

    model_dir: Path
    kernel_cache_dir: Path
    device: str = "auto"
    memory_utilization: float = 0.9
    backend: str = "auto"
    ranks: int = 1
    max_seq: int = 1024
    max_slots: int = 4

    @classmethod
    def make(cls, model_dir: Path | None = None, kernel_cache: Path | None = None, **kw: Any) -> Settings:
        return cls(model_dir or default_model_dir(), kernel_cache or kernel_cache_dir(), **kw)


# ---------------------------------------------------------------------------------------------
# Snapshots


@dataclass(frozen=True)
class ProgramsSnapshot:
    root: str
    entries: tuple[dict[str, Any], ...] = ()  # kernel_cache.Entry.to_json()
    warning: str = ""
    error: str = ""

    def totals(self) -> dict[str, Any]:
        counts = Counter(e["state"] for e in self.entries)
        return {"entries": len(self.entries), "size_bytes": sum(e["size_bytes"] for e in self.entries),
                "by_state": {s: counts[s] for s in kc.STATES if counts[s]}}


@dataclass(frozen=True)
class SidecarsSnapshot:
    model_dir: str
    sidecars: tuple[dict[str, Any], ...] = ()  # Verdict.to_json() + sampled_at + next_launch
    judged_against: str = "settings recorded in each sidecar"
    error: str = ""


@dataclass(frozen=True)
class HostSnapshot:
    cpu_percent: float = 0.0
    per_core: tuple[float, ...] = ()
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    mem_total: int = 0
    mem_available: int = 0
    page_cache: int = 0
    disk_read_bps: float = 0.0
    disk_write_bps: float = 0.0
    history: dict[str, tuple[float, ...]] = field(default_factory=dict)  # cpu, mem_available, read, write


@dataclass(frozen=True)
class DeviceSnapshot:
    kind: str
    source: str  # meminfo | nvml | npu-smi
    utilization: float
    devices: tuple[dict[str, Any], ...] = ()  # name, total, used, free, budget, warning
    slot_bytes: int | None = None  # one KV slot, from the last launch of this model
    error: str = ""


@dataclass(frozen=True)
class RegistrationSnapshot:
    previous: dict[str, Any] | None = None  # launch-history record of the last launch of this model
    best_warm: dict[str, Any] | None = None  # the fastest ok launch with every program HIT and weights MAP
    prediction: dict[str, str] = field(default_factory=dict)  # phase → predicted path
    basis: str = ""  # what the prediction is based on
    earlier: dict[str, Any] | None = None  # the launch before `previous`


@dataclass(frozen=True)
class Snapshot:
    ts: float
    settings: dict[str, Any]
    programs: ProgramsSnapshot
    sidecars: SidecarsSnapshot
    host: HostSnapshot
    device: DeviceSnapshot
    registration: RegistrationSnapshot
    services: ServicesSnapshot = field(default_factory=ServicesSnapshot)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "ts": self.ts, "settings": self.settings,
                **{k: dataclasses.asdict(getattr(self, k))
                   for k in ("programs", "sidecars", "services", "host", "device", "registration")}}


# ---------------------------------------------------------------------------------------------
# Collectors


def collect_programs(root: Path, reference: kc.Reference | None) -> ProgramsSnapshot:
    if not root.exists():
        return ProgramsSnapshot(str(root), warning="no cache yet (created by the first compile)")
    try:
        cache = kc.KernelCache(root)
        entries = tuple(e.to_json() for e in cache.inventory(reference))
        return ProgramsSnapshot(str(root), entries, warning=cache.trust_problem() or "")
    except Exception as e:  # a collector never takes the console down
        return ProgramsSnapshot(str(root), error=f"{type(e).__name__}: {e}")


def next_launch(verdict: dict[str, Any]) -> str:
    """What the next launch would do with this sidecar, in words."""
    if verdict["verdict"] == sc.MAP:
        return "MAP (cold: reads uncached bytes)" if verdict.get("cold_read") else "MAP"
    return f"REPACK ({verdict['reason']})"


def collect_sidecars(model_dir: Path, ranks: int = 1) -> SidecarsSnapshot:
    now = time.time()
    if not model_dir.is_dir():
        return SidecarsSnapshot(str(model_dir), error="no checkpoint here yet")
    try:
        paths = sc.find_sidecars(model_dir)
        wanted = sc.default_sidecar_path(model_dir, ranks)
        rows = []
        for p in paths:
            v = sc.inspect(p).to_json()
            rows.append({**v, "sampled_at": now, "next_launch": next_launch(v), "wanted": p == wanted})
        if wanted not in paths:
            rows.append({"path": str(wanted), "verdict": sc.REPACK, "reason": "missing",
                         "detail": "no sidecar for these ranks; prepack to create it", "residency": None,
                         "residency_method": None, "size_bytes": 0, "sampled_at": now,
                         "next_launch": "REPACK (missing)", "wanted": True})
        return SidecarsSnapshot(str(model_dir), tuple(rows))
    except Exception as e:
        return SidecarsSnapshot(str(model_dir), error=f"{type(e).__name__}: {e}")


class HostCollector:
    """psutil rates between two calls, plus a short history for sparklines."""

    def __init__(self) -> None:
        self._disk = self._disk_counters()
        self._t = time.monotonic()
        psutil.cpu_percent(percpu=True)  # prime: the next call measures since now
        self._history: dict[str, deque[float]] = {k: deque(maxlen=HISTORY_POINTS)
                                                  for k in ("cpu", "mem_available", "read", "write")}

    @staticmethod
    def _disk_counters() -> tuple[int, int]:
        with contextlib.suppress(Exception):
            d = psutil.disk_io_counters()
            if d is not None:
                return d.read_bytes, d.write_bytes
        return 0, 0

    def __call__(self) -> HostSnapshot:
        per_core = tuple(psutil.cpu_percent(percpu=True))
        now, disk = time.monotonic(), self._disk_counters()
        dt = max(now - self._t, 1e-3)
        read, write = (max(0, disk[0] - self._disk[0]) / dt, max(0, disk[1] - self._disk[1]) / dt)
        self._disk, self._t = disk, now
        vm = psutil.virtual_memory()
        cpu = sum(per_core) / len(per_core) if per_core else 0.0
        for k, v in (("cpu", cpu), ("mem_available", vm.available), ("read", read), ("write", write)):
            self._history[k].append(float(v))
        load = (0.0, 0.0, 0.0)
        with contextlib.suppress(OSError, AttributeError):
            load = os.getloadavg()
        return HostSnapshot(round(cpu, 1), per_core, tuple(round(x, 2) for x in load), vm.total, vm.available,
                            getattr(vm, "cached", 0), read, write,
                            {k: tuple(v) for k, v in self._history.items()})


def resolve_device_kind(device: str) -> str:
    """`auto` → npu if npu-smi is on PATH, cuda if NVML answers, else cpu (never a device context)."""
    if device != "auto":
        return device
    if shutil.which("npu-smi"):
        return "npu"
    if _nvml_devices() is not None:
        return "cuda"
    return "cpu"


def _nvml_devices() -> list[tuple[str, int, int]] | None:
    """[(name, total, used)] through NVML, or None when pynvml is absent or no driver answers."""
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                out.append((f"cuda:{i} {name.decode() if isinstance(name, bytes) else name}",
                            int(mem.total), int(mem.used)))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


# `npu-smi info` prints, per NPU, a row whose HBM column reads "used / total" in MB.
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|")
_NPU_HBM = re.compile(r"(\d+)\s*/\s*(\d+)\s*\|?\s*$")


def _npu_devices() -> list[tuple[str, int, int]] | None:
    try:
        text = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out, current = [], None
    for line in text.splitlines():
        m = _NPU_ROW.match(line)
        if m:
            current = f"npu:{m.group(1)} {m.group(2)}"
            continue
        hbm = _NPU_HBM.search(line)
        if current and hbm:
            used, total = int(hbm.group(1)) << 20, int(hbm.group(2)) << 20
            out.append((current, total, used))
            current = None
    return out or None


def collect_device(kind: str, utilization: float, slot_bytes: int | None) -> DeviceSnapshot:
    """used / free / total per device and the KV budget (total × utilization − used), the same
    formula registration's kv phase applies, so a starving budget shows before launch."""
    if kind == "cuda":
        found, source = _nvml_devices(), "nvml"
    elif kind == "npu":
        found, source = _npu_devices(), "npu-smi"
    else:
        vm = psutil.virtual_memory()
        found, source = [("cpu (host memory)", vm.total, vm.total - vm.available)], "meminfo"
    if found is None:
        return DeviceSnapshot(kind, source, utilization, error=f"{source} did not answer")
    rows = []
    for name, total, used in found:
        budget = int(total * utilization) - used
        warning = ""
        if budget <= 0:
            warning = (f"residual usage leaves no KV budget (total × {utilization} − used ≤ 0): "
                       "the launch would fail at kv")
        elif slot_bytes and budget < slot_bytes:
            warning = "budget is below one KV slot: the launch would fail at kv"
        rows.append({"name": name, "total": total, "used": used, "free": max(0, total - used),
                     "budget": budget, "slots": (budget // slot_bytes) if slot_bytes and budget > 0 else None,
                     "warning": warning})
    return DeviceSnapshot(kind, source, utilization, tuple(rows), slot_bytes)


def launch_seconds(record: dict[str, Any]) -> float:
    return sum(float(p.get("seconds") or 0) for k, p in record.get("phases", {}).items() if k in PHASES)


def is_warm(record: dict[str, Any]) -> bool:
    phases = record.get("phases", {})
    counts = phases.get("programs", {}).get("counts", {})
    return (record.get("outcome") == "ok" and not counts.get("MISS") and not counts.get("STALE")
            and phases.get("weights", {}).get("path") == "MAP")


def predict(settings: Settings, history: list[dict[str, Any]], programs: ProgramsSnapshot,
            sidecars: SidecarsSnapshot, device: DeviceSnapshot) -> RegistrationSnapshot:
    """The path each phase will take at the next launch.

    Programs: the model's program names cannot be computed without torch, so they come from the
    last launch of this model in the launch history; each is HIT when the cache holds a
    `current` entry of that name, STALE when only stale ones, else MISS. Weights: the sidecar
    verdict. KV: the device budget over the slot size that launch recorded."""
    mine = [r for r in history if r.get("model") == str(settings.model_dir)]
    previous = mine[-1] if mine else None
    warm = [r for r in mine if is_warm(r)]
    best = min(warm, key=launch_seconds) if warm else None
    pred: dict[str, str] = {"check": "contract check"}
    basis = []
    states: dict[str, set[str]] = {}
    for e in programs.entries:
        states.setdefault(e["program"], set()).add(e["state"])
    names = next((list(r["phases"]["programs"].get("programs") or {}) for r in reversed(mine)
                  if r.get("phases", {}).get("programs", {}).get("programs")), None)
    if settings.backend == "eager":
        pred["programs"] = "EAGER (no cache)"
    elif names:
        outcome = Counter("HIT" if kc.CURRENT in states.get(n, ()) else
                          "STALE" if kc.STALE in states.get(n, ()) else "MISS" for n in names)
        pred["programs"] = " ".join(f"{k} {outcome[k]}" for k in ("HIT", "STALE", "MISS") if outcome[k])
        basis.append(f"{len(names)} programs from the last launch of this model")
    else:
        current = sum(1 for s in states.values() if kc.CURRENT in s)
        pred["programs"] = f"? ({current} programs current in the cache)"
        basis.append("no launch of this model in the history: program set unknown")
    wanted = str(sc.default_sidecar_path(settings.model_dir, settings.ranks))
    verdict = next((s for s in sidecars.sidecars if s["path"] == wanted), None)
    pred["weights"] = verdict["next_launch"] if verdict else "REPACK (missing)"
    pred["upload"] = "zero-copy (cpu)" if device.kind == "cpu" else "copy to device"
    if device.devices:
        d = device.devices[0]
        if d["warning"]:
            pred["kv"] = "FAIL: " + d["warning"]
        elif d["slots"] is not None:
            pred["kv"] = f"{min(settings.max_slots, d['slots'])} slots"
        else:
            pred["kv"] = f"budget {format_size(max(0, d['budget']))}"
    pred["validate"] = "decode check"
    pred["serve"] = "HTTP"
    earlier = mine[-2] if len(mine) > 1 else None
    return RegistrationSnapshot(previous, best, pred, "; ".join(basis), earlier)


def last_slot_bytes(history: list[dict[str, Any]], model_dir: Path, max_seq: int) -> int | None:
    for r in reversed(history):
        kv = r.get("phases", {}).get("kv", {})
        if r.get("model") == str(model_dir) and kv.get("slot_bytes") and kv.get("max_seq") == max_seq:
            return int(kv["slot_bytes"])
    return None


class Collectors:
    """Every pane's snapshot for one set of settings; the console calls `snapshot()` off the UI."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.device_kind = resolve_device_kind(settings.device)
        self.host = HostCollector()
        self._reference: kc.Reference | None = None
        self._history: list[dict[str, Any]] = []
        self._history_stamp: tuple[int, int] | None = None

    def reference(self) -> kc.Reference | None:
        if self._reference is None:
            with contextlib.suppress(Exception):
                from runtime.programs import reference

                dev = self.device_kind
                self._reference = reference(device=dev)
        return self._reference

    def history(self) -> list[dict[str, Any]]:
        """The launch history, re-read only when the file changed (it only grows)."""
        from runtime.registration import history_path, read_history

        try:
            st = history_path().stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            return []
        if stamp != self._history_stamp:
            try:
                self._history = read_history(limit=500)
            except OSError:
                return []
            self._history_stamp = stamp
        return self._history

    def snapshot(self) -> Snapshot:
        s = self.settings
        history = self.history()
        programs = collect_programs(s.kernel_cache_dir, self.reference())
        sidecars = collect_sidecars(s.model_dir, s.ranks)
        device = collect_device(self.device_kind, s.memory_utilization,
                                last_slot_bytes(history, s.model_dir, s.max_seq))
        registration = predict(s, history, programs, sidecars, device)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(s).items()}
        settings["device"] = self.device_kind
        return Snapshot(time.time(), settings, programs, sidecars, self.host(), device, registration,
                        collect_services())
