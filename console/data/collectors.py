"""Collectors: plain Python that returns immutable snapshots of what the console shows.

The Programs, Sidecars and Registration panes render the plan of the next launch
(`runtime.launch.plan`, torch-free, kept by `console.data.plan_watch`): nothing here judges a cache or
predicts a program outcome itself. Nothing imports torch or opens a device context. Panes only
render these snapshots, `--once --json` prints them (the plan under `plan`), and tests feed
fake ones. Every collector turns its own failure into an `error` string on its snapshot.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

from console.data.cache import free_bytes
from console.data.host import DeviceSnapshot, HostCollector, collect_device
from console.data.nodes import node_views
from console.data.plan_watch import PlanWatch
from console.data.records import LaunchRecord
from console.data.services import ServicesCollector
from console.data.snapshot import (
    LOCAL,
    OtherSidecar,
    ProgramsSnapshot,
    RegistrationSnapshot,
    SidecarsSnapshot,
    Snapshot,
)
from runtime.launch.history import basis_line, comparable, is_warm, launch_seconds
from runtime.launch.plan_report import CHECK, PLAN_FAILED, PlanReport
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from runtime.serve.access import Access
from store import sidecar as sc
from store.paths import default_model_dir, default_preset, kernel_cache_dir  # noqa: F401
from store.units import format_size

HISTORY_SHIPPED = 50  # launch records a snapshot carries when asked for them
RESIDENCY_DRIFT = 0.02  # a fresh sample this far from the plan's re-plans (hot/cold may have flipped)


def resolved(spec: LaunchSpec) -> LaunchSpec:
    """The console's launch spec with its paths resolved (the embedded default model, the kernel
    cache dir the environment names): what every action it starts is told, explicitly."""
    return spec.with_(model=Path(spec.model) if spec.model else default_model_dir(),
                      kernel_cache_dir=kernel_cache_dir(spec.kernel_cache_dir))


def console_spec(model: Path | str | None = None, kernel_cache: Path | str | None = None, **kw: Any) -> LaunchSpec:
    """`resolved(LaunchSpec(…))`, for the console's tests and tools."""
    return resolved(LaunchSpec(model=Path(model) if model else None,
                               kernel_cache_dir=Path(kernel_cache) if kernel_cache else None, **kw))


def programs_of(plan: PlanReport, root: Path) -> ProgramsSnapshot:
    return ProgramsSnapshot(root=str(root), entries=plan.programs,
                            problem=plan.problem(CHECK) or plan.problem(PLAN_FAILED))


def sidecars_of(plan: PlanReport, model_dir: Path) -> SidecarsSnapshot:
    """The plan's sidecar (the one the next launch maps or replaces), then any other sidecar
    files beside the checkpoint, listed without a verdict: the next launch does not use them."""
    judged = plan.sidecar
    if judged is None:
        problems = "; ".join(p.line() for p in plan.problems)
        return SidecarsSnapshot(model_dir=str(model_dir), error=problems or "no plan")
    try:
        others = [p for p in sc.find_sidecars(model_dir) if str(p) != judged.path]
    except OSError:
        others = []
    return SidecarsSnapshot(model_dir=str(model_dir), wanted=judged,
                            others=tuple(OtherSidecar(path=str(p), size_bytes=_size(p), ranks=sc.ranks_of(p))
                                         for p in others),
                            disk_free=free_bytes(Path(judged.path or model_dir)))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _record(raw: dict[str, Any] | None) -> LaunchRecord | None:
    return LaunchRecord.of(raw) if raw else None


def predict(spec: LaunchSpec, history: list[dict[str, Any]], plan: PlanReport,
            device: DeviceSnapshot) -> RegistrationSnapshot:
    """The plan's path for each phase in words, with the launches it is compared with: only
    launches like it (`runtime.launch.history.comparable`, the plan's own matcher)."""
    like = plan.like
    alike = comparable(history, like)
    same = [r for r in alike if like.same_paths(r)] if like else []
    warm = [r for r in alike if is_warm(r)]
    pred: dict[str, str] = {}
    check = plan.problem(CHECK)
    pred["check"] = f"FAIL: {check.text}" if check else "contract check"
    counts = Counter(p.state for p in plan.programs)
    pred["programs"] = " ".join(f"{s} {counts[s]}" for s in Outcome if counts[s]) or "-"
    if plan.ready == "early" and counts:
        pred["programs"] += " (eager until compiled: --ready early)"
    pred["weights"] = plan.sidecar.next_launch() if plan.sidecar else "-"
    pred["upload"] = "zero-copy (cpu)" if device.kind == "cpu" else "copy to device"
    kv = plan.kv
    if kv is not None and kv.problem:
        pred["kv"] = f"FAIL: {kv.problem}"
    elif kv is not None and kv.slots is not None:
        per_rank = [b.slots for b in kv.per_rank]  # the service's slots are their sum
        split = f" ({' + '.join(map(str, per_rank))})" if len(per_rank) > 1 else ""
        pred["kv"] = f"{kv.slots} slots{split} of {format_size(kv.slot_bytes or 0)}" + (" each" if split else "")
    else:
        pred["kv"] = kv.detail if kv is not None and kv.detail else "-"
    pred["validate"] = "decode check"
    pred["serve"] = "HTTP"
    return RegistrationSnapshot(previous=_record(same[-1] if same else None),
                                best_warm=_record(min(warm, key=launch_seconds) if warm else None),
                                prediction=pred, basis=basis_line(dict(plan.basis), same[-1] if same else None),
                                earlier=_record(same[-2] if len(same) > 1 else None), predicted=dict(plan.predicted))


def _sample(path: str | None):
    """Residency of a regular file (never blocks on a FIFO), or None."""
    import os
    import stat

    from store import pagecache

    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return pagecache.residency(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


class Collectors:
    """Every pane's snapshot for one launch spec, collected on this host (`snapshot()`, off the UI).
    `local_ranks`: the service's ranks that run here (a service across hosts)."""

    def __init__(self, spec: LaunchSpec, local_ranks: int | None = None):
        from runtime.launch.hardware import resolve_device
        from runtime.toolchain import stay_torch_free

        stay_torch_free()  # the plan reads program keys: never through torch, never opening a device
        self.spec = spec
        self.local_ranks = local_ranks
        self.device_kind = resolve_device(spec.device)
        self.host = HostCollector()
        self.services = ServicesCollector(Access.of(spec.api_key_file, spec.ca_file))
        self.plans = PlanWatch(spec, local_ranks=local_ranks)
        self._history: list[dict[str, Any]] = []
        self._history_stamp: tuple[int, int] | None = None
        self._toolchain: dict[str, str] | None = None

    def history(self) -> list[LaunchRecord]:
        """The launch history, one record per launch, oldest first."""
        return [LaunchRecord.of(r) for r in self.history_lines()]

    def history_lines(self) -> list[dict[str, Any]]:
        """The launch history's lines, re-read only when the file changed (it only grows)."""
        from store.history import history_path, read_history

        try:
            st = history_path().stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            return []
        if stamp != self._history_stamp:
            try:
                self._history = read_history(limit=500)
            except Exception:  # an unreadable history is an empty one here, never a crash
                return []
            self._history_stamp = stamp
        return self._history

    def plan(self) -> tuple[Any, PlanReport]:
        return self.plans.get(self.history_lines())

    def _residency(self, history: list[dict[str, Any]]) -> PlanReport:
        """The plan, with its sidecar's residency sampled now (cachestat: every refresh; the
        mincore fallback: on the schedule `store.pagecache.schedule` sets); re-planned when the
        sample moved away from what the plan's verdict was made with."""
        _, plan = self.plans.get(history)
        side = plan.sidecar
        res = _sample(side.path if side else None)
        if side is None or res is None or side.residency is None:
            return plan
        if abs(res.fraction - side.residency) > RESIDENCY_DRIFT:
            self.plans.invalidate()
            _, plan = self.plans.get(history)
            side = plan.sidecar
            if side is None:
                return plan
        sampled = dataclasses.replace(side, residency=res.fraction, residency_method=res.method,
                                      sampled_at=res.sampled_at)
        return dataclasses.replace(plan, sidecar=sampled)

    def snapshot(self, with_history: bool = False) -> Snapshot:
        """Every pane's data now; `with_history`: the launch history's last records too."""
        s = self.spec
        now = time.time()
        history = self.history_lines()
        plan = self._residency(history)
        if plan.sidecar is not None and plan.sidecar.sampled_at is None:
            plan = dataclasses.replace(plan, sidecar=dataclasses.replace(plan.sidecar, sampled_at=now))
        device = collect_device(s.with_(ranks=self.local_ranks or s.ranks), self.device_kind,
                                plan.kv.slot_bytes if plan.kv else None)
        return Snapshot(ts=now, settings=s.with_(device=self.device_kind),
                        programs=programs_of(plan, s.kernel_cache_dir),
                        sidecars=sidecars_of(plan, s.model), host=self.host(), device=device,
                        registration=predict(s, history, plan, device), services=self.services(), plan=plan,
                        cache=self.plans.cache, host_name=LOCAL, hostname=socket.gethostname(),
                        toolchain=self.toolchain(), nodes=node_views(),
                        history=tuple(LaunchRecord.of(r) for r in history[-HISTORY_SHIPPED:]) if with_history else ())

    def toolchain(self) -> dict[str, str]:
        """This host's toolchain (read once: it changes only with an install, which restarts us)."""
        if self._toolchain is None:
            from console.data.toolchain import toolchain

            try:
                self._toolchain = toolchain(self.device_kind)
            except Exception as e:  # a collector never takes the console down
                self._toolchain = {"error": f"{type(e).__name__}: {e}"}
        return self._toolchain
