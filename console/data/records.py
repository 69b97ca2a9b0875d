"""Launch-history records as the console carries them: one `LaunchRecord` per launch (which
service, where, when, how it ended) with each phase's seconds and the path it took in words.

Made once from a history line (`of`: `runtime.launch.history`'s format, read on the host that
wrote it), then frozen: the snapshot carries them across hosts, the Registration pane compares a
launch with them, the history view lists them. The fleet merges one launch's records from several
hosts (`merged`: `store.history.merge`'s rule). Torch-free, no Textual.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any


def path_taken(phase: str, detail: Mapping[str, Any]) -> str:
    """The path a finished phase took, in a few words (from its `end` event's detail)."""
    if "counts" in detail:
        return " ".join(f"{k} {v}" for k, v in detail["counts"].items() if v)
    if "path" in detail:
        return str(detail["path"]) + (f" ({detail['reason']})" if detail.get("reason") else "")
    if "rank_slots" in detail:  # each rank holds its own slots: the service has their sum
        return f"{detail['total_slots']} slots ({' + '.join(map(str, detail['rank_slots']))})"
    if "slots" in detail:
        return f"{detail['slots']} slots"
    if "url" in detail:  # the URL itself is in the summary ("serving …"); a column keeps the path short
        return "HTTP"
    if phase == "upload" and "zero_copy" in detail:
        return "zero-copy" if detail["zero_copy"] else "copied"
    if phase == "validate" and "health" in detail:
        return str(detail["health"])
    return ""


@dataclass(frozen=True, kw_only=True)
class PhaseRecord:
    """One phase of a launch: its seconds, the path it took, or its error."""

    seconds: float | None = None
    path: str = ""
    error: str = ""

    def line(self) -> str:
        """`0.42 s MAP`, `1.20 s error`."""
        from console import fmt

        return f"{fmt.secs(self.seconds)} {'error' if self.error else self.path}".strip()

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "path": self.path, "error": self.error}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PhaseRecord:
        return cls(seconds=raw.get("seconds"), path=str(raw.get("path") or ""), error=str(raw.get("error") or ""))


@dataclass(frozen=True, kw_only=True)
class LaunchRecord:
    """One launch, as the history remembers it."""

    launch: str = ""  # the service's identity (store.services.ServiceId.key): one launch's lines share it
    started: float | None = None
    ended: float | None = None
    host: str = ""
    pid: int | None = None
    model: str = ""
    backend: str = ""
    device: str = ""
    ranks: int | None = None
    max_seq: int | None = None
    outcome: str = ""  # ok | error | killed | unknown
    error: str = ""
    end: str = ""  # how its service ended, when something other than the service said so
    failed_phase: str = ""
    phases: Mapping[str, PhaseRecord] = field(default_factory=dict)
    # the whole launch (its process's start to serving: the history line's `seconds`), and its
    # registration span beside the plan's prediction of the same span (runtime.launch.history)
    launch_seconds: float | None = None
    registration_seconds: float | None = None
    predicted_registration_seconds: float | None = None

    @property
    def seconds(self) -> float:
        """The whole launch's seconds (`history.launch_seconds`: the recorded ones, else its
        phases' through serve): what the Registration pane said as "this launch"."""
        from runtime.launch.history import whole_seconds

        return whole_seconds(self.launch_seconds, {k: p.seconds for k, p in self.phases.items()})

    def phase(self, name: str) -> PhaseRecord | None:
        return self.phases.get(name)

    def name(self) -> str:
        """`05-14 14:02:33 pid 4242 (ok, 0.90 s)`: which launch a comparison is with."""
        import time

        when = time.strftime("%m-%d %H:%M:%S", time.localtime(self.started or 0))
        return f"{when} pid {self.pid if self.pid is not None else '?'} ({self.outcome}, {self.seconds:.2f} s)"

    def merged(self, later: LaunchRecord) -> LaunchRecord:
        """A later record of the same launch (another host's, a launcher's) over this one: its
        words win, but phases this one has keep their seconds and the start stays."""
        said = {f.name: getattr(later, f.name) for f in fields(later)
                if f.name not in ("phases", "started") and getattr(later, f.name) not in (None, "")}
        return replace(self, **said, phases={**later.phases, **self.phases},
                       started=self.started if self.started is not None else later.started)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["phases"] = {k: p.to_json() for k, p in self.phases.items()}
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LaunchRecord:
        """`to_json`'s inverse, and a history line's reading (`of`) for one that has a phase's
        detail instead of its path."""
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw and f.name != "phases"}
        if "launch_seconds" not in raw and isinstance(raw.get("seconds"), int | float):  # a history line
            known["launch_seconds"] = raw["seconds"]
        for text in ("launch", "host", "model", "backend", "device", "outcome", "error", "end", "failed_phase"):
            known[text] = str(known.get(text) or "")
        phases = raw.get("phases") if isinstance(raw.get("phases"), Mapping) else {}
        return cls(**known, phases={str(k): _phase(str(k), v) for k, v in phases.items() if isinstance(v, Mapping)})

    of = from_json  # a line of the history file: the same reading


def _phase(name: str, raw: Mapping[str, Any]) -> PhaseRecord:
    if "path" in raw and "seconds" in raw and set(raw) <= {"seconds", "path", "error"}:
        return PhaseRecord.from_json(raw)  # one this module wrote
    error = raw.get("error")
    return PhaseRecord(seconds=raw.get("seconds"), path=path_taken(name, raw),
                       error=str(error) if error else "")
