"""The actions as they run, on any hosts: each host's job (its step, progress, outcome), the
orderings that matter — a launch starts node 0 first and relays the port it picked to the others;
a stop asks node 0 first (its rank 0 drains and stops the rest); an import comes from the host
holding most of what the target misses under the same keys — and every step and outcome told to
the fleet log as events. The console's controllers and `dsv4 fleet` only start actions here and
render what they tell; the tests drive it through fake hosts. Torch-free, no Textual.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from console.data.eta import Progress, follow
from console.data.launch_state import ProgramStates
from console.fleet import actions as A
from console.fleet import events as E
from console.fleet.command import STOP_TIMEOUT
from console.fleet.host import Host, HostReading
from runtime.events import Event
from runtime.launch.purge import Target
from runtime.launch.spec import LaunchSpec
from store import timeline as T


@dataclass
class HostJob:
    """What one host is doing for an action, or how it ended."""

    action: str
    step: str = ""
    progress: Progress | None = None
    pool: ProgramStates | None = None  # a compile's programs, one by one
    outcome: str = ""  # "" while it runs; "ok", or the failure in words
    started: float = field(default_factory=time.monotonic)
    took: float | None = None
    lines: list[str] = field(default_factory=list)  # what its commands printed that is not an event or a record
    records: list[dict[str, Any]] = field(default_factory=list)  # the JSON records its commands printed
    partial: list[str] = field(default_factory=list)  # the lines of a record being printed
    command: Any = None  # the command running now (console.fleet.command.Worker's face)
    failure: Event | None = None  # the parent's verdict on a command that failed (exit code, last stderr lines)

    @property
    def running(self) -> bool:
        return not self.outcome

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def line(self) -> str:
        """`warm (read) · 1.2 GiB / 8 GiB · ETA 4s`, `✓ warm 12s`, `✗ warm: <why>` (plain text)."""
        if not self.outcome:
            return self.progress.line() if self.progress and self.progress.total else f"{self.step}…"
        from console import fmt

        took = f" {fmt.duration(self.took)}" if self.took is not None else ""
        return f"✓ {self.action}{took}" if self.ok else f"✗ {self.action}: {self.outcome}"


Changed = Callable[[str, HostJob, Event | None], None]  # (host, its job, the event that moved it)


class Runner:
    """Runs actions on `hosts` (name → Host) for the launch `spec`; `jobs[host]` is each host's
    current or last job; `readings()` gives what is known of the hosts now (their snapshots)."""

    def __init__(self, hosts: Mapping[str, Host], spec: LaunchSpec, *, log: E.FleetLog | None = None,
                 readings: Callable[[], Sequence[HostReading]] = tuple, registry: str = "", insecure: bool = False,
                 on_change: Changed | None = None):
        self.hosts, self.spec = dict(hosts), spec
        self.log = log or E.FleetLog()
        self.readings, self.registry, self.insecure = readings, registry, insecure
        self.listeners: list[Changed] = [on_change] if on_change else []  # each hears every job that moves
        self.jobs: dict[str, HostJob] = {}

    def running(self) -> list[str]:
        return [h for h, j in self.jobs.items() if j.running]

    def _moved(self, host: str, job: HostJob, event: Event | None) -> None:
        for listen in list(self.listeners):
            listen(host, job, event)

    def _say(self, kind: str, host: str = T.FLEET, **kw: Any) -> None:
        self.log.add(T.TimelineEvent(kind=kind, host=host, **kw))

    def _snapshot(self, host: str):
        return next((r.snapshot for r in self.readings() if r.host == host), None)

    # -- an action, start to end ----------------------------------------------------------------

    @property
    def alone(self) -> bool:
        """A fleet of one (the one-host console): a launch there is one detached `dsv4 serve`."""
        return len(self.hosts) == 1

    async def run(self, action: str, hosts: Sequence[str], *, chosen: Mapping[str, Sequence[str]] | None = None,
                  scope: str = A.PLAN_SCOPE, service: int | None = None,
                  timeout: float = STOP_TIMEOUT) -> dict[str, HostJob]:
        """`action` on `hosts` (in node order: a launch's node 0 is the first); purge deletes
        `chosen[host]` (what its dry run listed and the operator confirmed); stop and dismiss act
        on one `service` (its pid on each host; a stop without one: the fleet's nodes), a stop's
        SIGKILL after `timeout`."""
        if action not in A.ACTIONS:
            raise ValueError(f"unknown action {action}")
        if action == "dismiss" and service is None:
            raise ValueError("dismiss: which service (its pid)?")
        started = time.monotonic()
        self._say(T.STARTED, action=action, hosts=tuple(hosts))
        jobs = {name: HostJob(action) for name in hosts}
        self.jobs.update(jobs)
        for name, job in jobs.items():
            self._moved(name, job, None)
        if action == "launch" and self.alone:
            await self._one(action, hosts[0], jobs[hosts[0]])
        elif action == "launch":
            await self.launch(hosts, jobs)
        elif action == "stop" and service is None:
            await self.stop(hosts, jobs)
        else:
            todo = ({"stop": A.Step(label=f"stop pid {service}", args=A.service_stop(service, timeout)),
                     "dismiss": A.Step(label=f"dismiss pid {service}", args=A.service_dismiss(service))}
                    if service else {})
            await asyncio.gather(*(self._one(action, name, jobs[name], chosen, scope, todo.get(action))
                                   for name in hosts))
        failed = [h for h, j in jobs.items() if not j.ok]
        self._say(T.ENDED, action=action, hosts=tuple(failed or hosts), ok=not failed,
                  seconds=time.monotonic() - started, text="; ".join(f"{h}: {jobs[h].outcome}" for h in failed))
        return jobs

    async def _one(self, action: str, name: str, job: HostJob, chosen: Mapping[str, Sequence[str]] | None = None,
                   scope: str = A.PLAN_SCOPE, step: A.Step | None = None) -> None:
        if action == "import":
            await self._import(name, job)
            return
        if step is not None:
            todo = [step]
        elif action == "purge":
            todo = [A.Step(label="purge", args=A.purge_args(self.spec, scope, list((chosen or {}).get(name, ()))))]
        elif action == "launch":  # a fleet of one: the service detached under its supervisor, its record said
            todo = [A.service_start(self.spec)]
        else:
            todo = A.steps(action, self.spec, self._snapshot(name), self.registry, self.insecure)
        for one in todo:
            if not await self.step(name, job, one):
                return
        if action == "launch" and (record := self.service_record(job)) is not None:
            self._say(T.STEP, name, action="launch", text=f"service up: pid {record['pid']}, log "
                      f"{record.get('log_file') or record.get('log')}")
        self.done(name, job, "ok")

    @staticmethod
    def service_record(job: HostJob) -> dict[str, Any] | None:
        """The registry record a one-host launch printed (`dsv4 service start --json`)."""
        return next((r for r in reversed(job.records) if "pid" in r and "cmdline" in r), None)

    async def listing(self, hosts: Sequence[str], scope: str = A.PLAN_SCOPE) -> dict[str, list[Target]]:
        """What a purge would delete on each host (`dsv4 purge --dry-run`), each file and why; a
        host that cannot say is left out, its job saying why."""
        async def one(name: str) -> tuple[str, list[Target] | None]:
            job = self.jobs[name] = HostJob("purge")
            ok = await self.step(name, job, A.Step(label="purge (listing)", args=A.purge_args(self.spec, scope)))
            job.outcome, job.took = ("ok" if ok else job.outcome), time.monotonic() - job.started
            self._moved(name, job, None)
            return name, [Target.from_json(t) for r in job.records for t in r.get("items", ())] if ok else None

        found = await asyncio.gather(*(one(h) for h in hosts))
        return {h: targets for h, targets in found if targets is not None}

    # -- a step: one command on one host ---------------------------------------------------------

    async def step(self, name: str, job: HostJob, step: A.Step) -> bool:
        """Run `step` on host `name` for `job`; False (the job failed, saying why) on a non-zero exit."""
        self.prepare(name, job, step)
        return await self.finish(name, job)

    def prepare(self, name: str, job: HostJob, step: A.Step, **pipes: int) -> None:
        """`step`'s command on host `name`, made (holding the pipe ends it is given) but not started."""
        job.step = step.label
        job.progress = Progress(step.label, step.unit, rate=step.rate, items=dict(step.items))
        self._say(T.STEP, name, action=job.action, text=step.label)
        job.command = self.hosts[name].command(job.action, step.args,
                                               on_event=lambda c, e: self._event(name, job, c, e),
                                               on_line=lambda c, which, line: self._line(name, job, which, line),
                                               **pipes)
        self._moved(name, job, None)

    async def finish(self, name: str, job: HostJob) -> bool:
        """Run the command `prepare` made to its end; False (the job failed, saying why) on a non-zero exit."""
        code = await job.command.run()
        if code != 0:
            self.done(name, job, self.hosts[name].why(code, list(job.command.stderr_tail)))
            return False
        return True

    def _event(self, name: str, job: HostJob, command: Any, event: Event) -> None:
        if event.kind == "error" and event.phase == command.name:  # the parent's verdict: `step` says it
            job.failure = event
            return
        if job.progress is not None:
            job.pool = follow(job.progress, job.pool, event)
        if event.message and event.kind != "progress":
            self._say(T.LINE, name, action=job.action, text=event.message)
        self._moved(name, job, event)

    def _line(self, name: str, job: HostJob, which: str, line: str) -> None:
        if not line.strip():
            return
        if which == "stdout" and (job.partial or line.lstrip().startswith(("{", "["))):
            # a command's JSON record (one line, or indented over several): read by the step, never logged raw
            job.partial.append(line)
            try:
                raw = json.loads("\n".join(job.partial))
            except ValueError:
                return  # inside a record still
            job.partial.clear()
            job.records.append(raw if isinstance(raw, dict) else {"items": raw})
            return
        if which == "stdout":
            job.lines.append(line)
        self._say(T.LINE, name, action=job.action, text=line)

    def done(self, name: str, job: HostJob, outcome: str) -> None:
        job.outcome, job.took = outcome, time.monotonic() - job.started
        if outcome != "ok":
            self._say(T.LINE, name, action=job.action, text=f"failed: {outcome}")
        self._moved(name, job, None)

    # -- the orderings ----------------------------------------------------------------------------

    async def launch(self, hosts: Sequence[str], jobs: Mapping[str, HostJob]) -> None:
        """`dsv4 node start` on node 0 (the first host: a free port there), then on every other
        host with that port, at once; none of them when node 0 fails."""
        first, rest = hosts[0], list(hosts[1:])
        step = A.node_start(self.spec, len(hosts), 0, self.hosts[first].rendezvous, 0)
        if not await self.step(first, jobs[first], step):
            for h in rest:
                self.done(h, jobs[h], f"not started: node 0 ({first}) failed")
            return
        record = next((r for r in reversed(jobs[first].records) if "master" in r and "pid" in r), None)
        if record is None:
            self.done(first, jobs[first], "node start said no record")
            for h in rest:
                self.done(h, jobs[h], f"not started: node 0 ({first}) said no master")
            return
        addr, _, port = str(record["master"]).rpartition(":")
        self.done(first, jobs[first], "ok")
        self._say(T.STEP, first, action="launch", text=f"node 0 up: torchrun pid {record['pid']}, master {addr}:{port}")

        async def other(rank: int, name: str) -> None:
            if await self.step(name, jobs[name], A.node_start(self.spec, len(hosts), rank, addr, int(port))):
                self.done(name, jobs[name], "ok")

        await asyncio.gather(*(other(i + 1, h) for i, h in enumerate(rest)))

    def node0(self, hosts: Sequence[str]) -> str | None:
        """The host among `hosts` running node 0 of a service (its running node record says so)."""
        for r in self.readings():
            if r.host in hosts and r.snapshot is not None and any(
                    v.running and v.node.node_rank == 0 for v in r.snapshot.nodes):
                return r.host
        return None

    async def stop(self, hosts: Sequence[str], jobs: Mapping[str, HostJob]) -> None:
        """Node 0 first: its rank 0 drains and stops the other ranks itself (a rank stopped under a
        serving rank 0 is a lost rank: the service fails); then whatever still runs elsewhere."""
        first = self.node0(hosts)
        if first is not None:
            await self._one("stop", first, jobs[first])
        await asyncio.gather(*(self._one("stop", h, jobs[h]) for h in hosts if h != first))

    async def _import(self, name: str, job: HostJob) -> None:
        """`cache export -o -` on the source piped straight into `cache import -` on `name` (the
        bytes never pass through the console), the source the host holding most of what it misses."""
        job.step = "choosing a source"
        readings = list(self.readings())
        target = next((r for r in readings if r.host == name), None)
        if target is None or target.snapshot is None:
            self.done(name, job, f"no snapshot of {name} to say what it misses")
            return
        source, programs = A.source_for(target, readings)
        if not source:
            self.done(name, job, "no other host holds what it misses under the same keys")
            return
        export, into = A.export_import(self.spec)
        self._say(T.STEP, name, action="import",
                  text=f"from {source}: {len(programs)} programs ({', '.join(programs)})")
        read, write = os.pipe()
        try:  # each command holds its own end: ours close at once, so each sees the other's end
            out = self.hosts[source].command("import", export, stdout=write)
            self.prepare(name, job, A.Step(label=f"import from {source} ({len(programs)} programs)", args=into),
                         stdin=read)
        finally:
            os.close(write)
            os.close(read)
        code, imported = await asyncio.gather(out.run(), self.finish(name, job))
        if not imported:
            return
        if code != 0:
            self.done(name, job, f"export on {source}: {self.hosts[source].why(code, list(out.stderr_tail))}")
            return
        self.done(name, job, "ok")
