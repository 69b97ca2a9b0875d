"""The fleet screen's actions: each confirmed with the hosts it touches, then started on the
fleet's runner (`console.fleet.runner`: the same code `dsv4 fleet` runs — node 0 first for a
launch and a stop, an import from the host holding the entries), each host's progress and outcome
rendered in its row and every event, in a sentence, in the fleet's log. A host can be left out
(`-`): the ranks, the plans and a launch then cover the others."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from console import fmt
from console.fleet import actions as A
from console.fleet.runner import HostJob
from console.fleet.session import FleetSession
from console.tui.screens.confirm import ConfirmScreen
from runtime.events import Event
from store import timeline as T


class FleetControl:
    """Starts the fleet's actions and renders what the runner and the hosts tell."""

    def __init__(self, app: Any, session: FleetSession):
        self.app, self.session = app, session
        self.log: list[tuple[str, str]] = []  # (host, sentence), for the fleet log and tests
        session.log.listeners.append(self._said)
        session.runner.listeners.append(self._moved)

    @property
    def jobs(self) -> dict[str, HostJob]:
        return self.session.runner.jobs

    @property
    def spec(self):
        return self.session.spec

    def running(self) -> list[str]:
        return self.session.runner.running()

    def _screen(self) -> Any:
        """The fleet screen, once the app installed and attached it."""
        try:
            screen = self.app.get_screen("fleet")
        except KeyError:  # a fleet of one: no fleet screen
            return None
        return screen if screen.is_attached else None

    def _said(self, event: T.TimelineEvent) -> None:
        """An event, in its sentence, in the fleet log (from the collector's thread too)."""
        if event.kind == T.PROGRESS:
            return
        self.log.append((event.host, event.sentence()))
        screen = self._screen()
        if screen is None:
            return
        try:
            self.app.call_from_thread(screen.add_event, event)
        except RuntimeError:  # on the app's own thread already
            screen.add_event(event)
        if event.kind == T.ENDED:
            self._ended(event)

    def _ended(self, event: T.TimelineEvent) -> None:
        if event.ok:
            self.app.notify(escape(event.sentence()), title="done")
        else:
            self.app.notify(escape(event.sentence()), title="failed", severity="error", timeout=8)
        if (screen := self._screen()) is not None:
            screen.action_refresh()

    def _moved(self, host: str, job: HostJob, event: Event | None) -> None:
        if (screen := self._screen()) is not None:
            screen.show()

    # -- asking ---------------------------------------------------------------------------------

    def act(self, action: str, hosts: list[str]) -> None:
        """`action` on `hosts`, confirmed with the hosts it touches (leave_out: at once)."""
        if action == "leave_out":
            self.leave_out(hosts)
            return
        if action not in A.ACTIONS:
            raise ValueError(f"unknown fleet action {action}")
        if action == "launch":
            hosts = self.session.active()  # a service is every host not left out
        if not hosts:
            self.app.notify("no host selected", severity="warning")
            return
        busy = [h for h in hosts if h in self.running()]
        if busy:
            self.app.notify(f"{action}: {', '.join(busy)} still busy with {self.jobs[busy[0]].action}",
                            severity="warning")
            return
        if action == "pull" and not self.session.registry:
            self.app.notify("pull: no registry; give one as `registry = \"HOST/REPO\"` in the fleet file "
                            "or --registry", severity="error")
            return
        if action == "launch" and (problem := self.session.launch_problem()):
            self.app.notify(escape(f"launch: {problem}"), severity="error", timeout=10)
            return
        if action == "purge":
            self.app.run_worker(self._purge(hosts), group="fleet")
            return
        on = f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}"
        left = f"\n(left out: {', '.join(sorted(self.session.left_out))})" if self.session.left_out else ""
        body = f"{A.WHAT[action]}.\n\nOn {on}: {', '.join(hosts)}{left}"
        self.app.push_screen(ConfirmScreen(f"{action} on {on}?", escape(body)),
                             lambda yes: self.run(action, hosts) if yes else self._cancelled(action))

    def _cancelled(self, action: str) -> None:
        self.session.log.add(T.TimelineEvent(kind=T.LINE, text=f"{action}: cancelled, nothing run"))

    def run(self, action: str, hosts: list[str], chosen: dict[str, list[str]] | None = None) -> None:
        self.app.run_worker(self.session.runner.run(action, hosts, chosen=chosen), group="fleet")

    async def _purge(self, hosts: list[str]) -> None:
        """What each host's plan lets a purge delete (each file and why), confirmed once, then
        only those files, each looked at again there before it goes."""
        listed = await self.session.runner.listing(hosts)
        chosen = {h: [t.path for t in ts] for h, ts in listed.items() if ts}
        if not chosen:
            self.app.notify("nothing to purge on " + ", ".join(hosts))
            return
        lines = []
        for h, ts in listed.items():
            lines.append(f"{h}: {len(ts)} files, {fmt.size(sum(t.size_bytes for t in ts))}")
            lines += [f"  {t.path}: {t.reason}" for t in ts[:8]]
            lines += [f"  … and {len(ts) - 8} more"] if len(ts) > 8 else []
        self.app.push_screen(ConfirmScreen(f"purge on {len(chosen)} hosts?", escape("\n".join(lines))),
                             lambda yes: self.run("purge", list(chosen), chosen) if yes else self._cancelled("purge"))

    def leave_out(self, hosts: list[str]) -> None:
        """Leave the selected hosts out, or (each already out) bring them back."""
        for name in hosts:
            try:
                if name in self.session.left_out:
                    self.session.bring_back(name)
                else:
                    self.session.leave_out(name)
            except ValueError as e:
                self.app.notify(str(e), severity="warning")
        if (screen := self._screen()) is not None:
            screen.action_refresh()
