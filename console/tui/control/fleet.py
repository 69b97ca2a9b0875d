"""The fleet's actions as they run: each confirmed with the hosts it touches, then run on every
one of them at once over SSH (`dsv4 …` worker processes, `console.fleet.actions`), each host's
progress and outcome in its row and every line in the fleet's log. The launch across hosts starts
node 0 first (its free port becomes the master's), then the others; the stop asks every host."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape

from console import fmt
from console.data.eta import Progress
from console.fleet import actions as A
from console.fleet.collector import FleetSetup
from console.fleet.spec import FleetHost
from console.fleet.ssh import why
from console.tui.screens.confirm import ConfirmScreen
from console.tui.workers import Worker
from runtime.events import Event


@dataclass
class HostJob:
    """What one host is doing for the fleet, or how its last action ended."""

    action: str
    step: str = ""
    progress: Progress | None = None
    outcome: str = ""  # "" while running; "ok" or the failure in words
    started: float = field(default_factory=time.monotonic)
    took: float | None = None
    lines: list[str] = field(default_factory=list)  # stdout lines that are not events (a command's output)

    def line(self) -> str:
        if not self.outcome:
            return escape(self.progress.line() if self.progress and self.progress.total else f"{self.step}…")
        took = f" {fmt.duration(self.took)}" if self.took is not None else ""
        if self.outcome == "ok":
            return f"[green]✓ {self.action}{took}[/]"
        return f"[red]✗ {self.action}: {escape(self.outcome)}[/]"


class FleetControl:
    """Runs fleet actions; `jobs[host]` is each host's current or last one."""

    def __init__(self, app: Any, setup: FleetSetup):
        self.app, self.setup = app, setup
        self.fleet, self.spec, self.ssh, self.collector = setup.fleet, setup.spec, setup.ssh, setup.collector
        self.registry, self.insecure = setup.registry, setup.insecure
        self.jobs: dict[str, HostJob] = {}
        self.log: list[tuple[str, str]] = []  # (host, line), for the fleet log and tests

    def say(self, host: str, text: str) -> None:
        from rich.markup import escape

        self.log.append((host, text))
        if (screen := self._screen()) is not None:
            screen.add_line(host, escape(text))

    def _screen(self) -> Any:
        """The fleet screen, once the app installed and attached it."""
        try:
            screen = self.app.get_screen("fleet")
        except KeyError:  # not installed yet (the app mounts it)
            return None
        return screen if screen.is_attached else None

    def _changed(self) -> None:
        if (screen := self._screen()) is not None:
            screen.show()

    def running(self) -> list[str]:
        return [h for h, j in self.jobs.items() if not j.outcome]

    # -- asking ---------------------------------------------------------------------------------

    def ask(self, action: str, hosts: list[str]) -> None:
        """Confirm `action` with the hosts it touches, then run it on all of them."""
        if action not in A.ACTIONS:
            raise ValueError(f"unknown fleet action {action}")
        busy = [h for h in hosts if h in self.running()]
        if busy:
            self.app.notify(f"{action}: {', '.join(busy)} still busy with {self.jobs[busy[0]].action}",
                            severity="warning")
            return
        if action == "pull" and not self.registry:
            self.app.notify("pull: no registry; give one as `registry = \"HOST/REPO\"` in the fleet file "
                            "or --registry", severity="error")
            return
        if action == "launch" and (problem := self.launch_problem()):
            self.app.notify(f"launch: {problem}", severity="error")
            return
        if action == "launch":
            hosts = [h.name for h in self.fleet.hosts]  # a service is every host of the fleet
        on = f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}"
        body = f"{A.WHAT[action]}.\n\nOn {on}: {', '.join(hosts)}"
        self.app.push_screen(ConfirmScreen(f"{action} on {on}?", body),
                             lambda yes: self.run(action, hosts) if yes else self.say("fleet", f"{action}: cancelled"))

    def launch_problem(self) -> str:
        if not self.spec.model:
            return "the fleet's launch needs a model ([launch] model, or --model): the path on every host"
        away = [r for r in self.collector.snapshot(wait=0).hosts if not r.reachable]
        if away:  # its ranks would wait out the rendezvous for a node that never comes
            return (f"{', '.join(r.host for r in away)} cannot be reached ({away[0].error}); a service needs every "
                    f"host of the fleet")
        return self.fleet.split(self.spec)

    def run(self, action: str, hosts: list[str]) -> None:
        self.say("fleet", f"{action} on {', '.join(hosts)}")
        if action == "launch":
            self.app.run_worker(self._launch(hosts), group="fleet")
        elif action == "stop":
            self.app.run_worker(self._stop(hosts), group="fleet")
        elif action == "import":
            for name in hosts:
                self.app.run_worker(self._import(self.fleet.host(name)), group="fleet")
        else:
            for name in hosts:
                self.app.run_worker(self._on_host(action, self.fleet.host(name)), group="fleet")

    async def _import(self, host: FleetHost) -> None:
        """`ssh SOURCE dsv4 cache export -o - …` piped straight into `ssh HOST dsv4 cache import - …`
        (the bytes never pass through the console), SOURCE the host holding most of what HOST misses."""
        import asyncio
        import os

        job = self.jobs[host.name] = HostJob("import", step="choosing a source")
        self._changed()
        readings = self.collector.snapshot(wait=0).hosts
        target = next((r for r in readings if r.host == host.name), None)
        if target is None or target.snapshot is None:
            self._done(host.name, job, f"no snapshot of {host.name} to say what it misses")
            return
        source, programs = A.source_for(target, readings)
        if not source:
            self._done(host.name, job, "no other host holds what it misses under the same keys")
            return
        export, imp = A.export_import(self.spec)
        job.step = f"import from {source} ({len(programs)} programs)"
        self.say(host.name, f"{job.step}: {', '.join(programs)}")
        self._changed()
        read, write = os.pipe()
        try:
            out = await asyncio.create_subprocess_exec(*self.ssh.argv(self.fleet.host(source), *export.remote),
                                                       stdin=asyncio.subprocess.DEVNULL, stdout=write,
                                                       stderr=asyncio.subprocess.PIPE, start_new_session=True)
            into = await asyncio.create_subprocess_exec(*self.ssh.argv(host, *imp.remote), stdin=read,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, start_new_session=True)
        finally:
            os.close(read)
            os.close(write)
        (_, out_err), (said, into_err) = await asyncio.gather(out.communicate(), into.communicate())
        for line in said.decode(errors="replace").splitlines():
            job.lines.append(line)
            self.say(host.name, line)
        lines = {name: err.decode(errors="replace").splitlines() for name, err in ((source, out_err), (host.name, into_err))}
        if out.returncode != 0:
            self._done(host.name, job, f"export on {source}: {why(self.fleet.host(source), out.returncode, lines[source])}")
        elif into.returncode != 0:
            self._done(host.name, job, why(host, into.returncode, lines[host.name]))
        else:
            self._done(host.name, job, "ok")

    async def _stop(self, hosts: list[str]) -> None:
        """Node 0 first: its rank 0 drains and stops the other ranks itself (a rank stopped under
        a serving rank 0 is a lost rank: the service fails); then whatever still runs elsewhere."""
        import asyncio

        ordered = sorted((self.fleet.host(h) for h in hosts), key=lambda h: h.node_rank)
        if ordered[0].node_rank == 0:
            await self._on_host("stop", ordered.pop(0))
        await asyncio.gather(*(self._on_host("stop", h) for h in ordered))

    # -- running ----------------------------------------------------------------------------------

    def _snapshot(self, host: str):
        stream = self.collector.streams.get(host)
        return stream.snapshot if stream is not None else None

    async def _on_host(self, action: str, host: FleetHost) -> None:
        job = self.jobs[host.name] = HostJob(action)
        for step in A.steps(action, self.spec, self._snapshot(host.name), self.registry, self.insecure):
            if not await self._step(host, job, step):
                return
        self._done(host.name, job, "ok")

    async def _step(self, host: FleetHost, job: HostJob, step: A.Step) -> bool:
        job.step, job.progress = step.label, Progress(step.label)
        self._changed()
        worker = Worker(f"{host.name}", self.ssh.argv(host, *step.remote),
                        on_event=lambda w, e: self._event(host.name, job, e),
                        on_line=lambda w, which, line: self._line(host.name, job, which, line))
        self.say(host.name, f"{step.label}: {' '.join(step.remote[:3])} …")
        code = await worker.run()
        if code != 0:
            self._done(host.name, job, why(host, code, list(worker.stderr_tail)))
            return False
        return True

    def _event(self, host: str, job: HostJob, event: Event) -> None:
        if event.kind == "error" and event.phase == host:  # the worker's own verdict: _step says it
            return
        p = job.progress
        if event.kind == "progress" and p is not None:
            p.update(event.done, event.total, now=str(event.detail.get("program") or event.detail.get("file") or ""))
        elif event.kind == "start" and p is not None and isinstance(event.total, int | float):
            p.update(0, event.total)
        if event.message and event.kind != "progress":
            self.say(host, event.message)
        self._changed()

    def _line(self, host: str, job: HostJob, which: str, line: str) -> None:
        if not line.strip():
            return
        if which == "stdout":
            job.lines.append(line)
        self.say(host, line)

    def _done(self, host: str, job: HostJob, outcome: str) -> None:
        job.outcome, job.took = outcome, time.monotonic() - job.started
        self.say(host, f"{job.action}: {'done' if outcome == 'ok' else outcome}")
        if outcome != "ok":
            self.app.notify(f"{host}: {job.action}: {outcome}", severity="error", timeout=8)
        elif not self.running():
            self.app.notify(f"{job.action} done on every host", title="done")
        self._changed()
        if (screen := self._screen()) is not None:
            screen.action_refresh()

    async def _launch(self, hosts: list[str]) -> None:
        """`dsv4 node start` on node 0 (a free port there), then on every other host with it."""
        import asyncio

        ordered = [self.fleet.host(h) for h in hosts]
        first = ordered[0]
        jobs = {h.name: HostJob("launch") for h in ordered}
        self.jobs.update(jobs)
        step = A.node_start(self.spec, len(ordered), 0, first.rendezvous, 0)
        if not await self._step(first, jobs[first.name], step):
            for h in ordered[1:]:
                self._done(h.name, jobs[h.name], f"not started: node 0 ({first.name}) failed")
            return
        record = _record(jobs[first.name].lines)
        if record is None:
            self._done(first.name, jobs[first.name], "node start said no record")
            return
        addr, _, port = str(record["master"]).rpartition(":")
        self._done(first.name, jobs[first.name], "ok")
        self.say("fleet", f"master {addr}:{port} (node 0 on {first.name}, torchrun pid {record['pid']})")

        async def other(host: FleetHost) -> None:
            step = A.node_start(self.spec, len(ordered), host.node_rank, addr, int(port))
            if await self._step(host, jobs[host.name], step):
                self._done(host.name, jobs[host.name], "ok")

        await asyncio.gather(*(other(h) for h in ordered[1:]))


def _record(lines: list[str]) -> dict[str, Any] | None:
    for line in reversed(lines):
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict) and "master" in raw and "pid" in raw:
            return raw
    return None
