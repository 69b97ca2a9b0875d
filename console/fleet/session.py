"""A fleet as the console and `dsv4 fleet` work with it: its hosts (each a Host), the launch they
share, the collector of their readings, the runner of their actions, the log of what happened,
and the hosts the operator left out (the ranks, the plans and a launch then cover the others).
The one-host console is a fleet of one: this host. Torch-free, no Textual."""

from __future__ import annotations

from collections.abc import Sequence

from console.fleet import events as E
from console.fleet.collector import FleetCollector
from console.fleet.host import Host
from console.fleet.runner import Runner
from console.fleet.spec import Fleet
from runtime.launch.spec import LaunchSpec
from store import timeline as T


class FleetSession:
    def __init__(self, hosts: Sequence[Host], spec: LaunchSpec, *, fleet: Fleet | None = None, registry: str = "",
                 insecure: bool = False, left_out: Sequence[str] = (), answer: float | None = None):
        """`spec`: the launch every host shares (its ranks the whole fleet's); `fleet`: where the
        hosts came from (--hosts, a fleet file; None: this host alone)."""
        self.fleet, self.base, self.registry, self.insecure = fleet, spec, registry, insecure
        self.hosts = {h.name: h for h in sorted(hosts, key=lambda h: h.node_rank)}
        self.left_out: frozenset[str] = frozenset(left_out)
        self.log = E.FleetLog()
        self.collector = FleetCollector(list(self.hosts.values()), log=self.log,
                                        **({"answer": answer} if answer is not None else {}))
        self.runner = Runner(self.hosts, self.spec, log=self.log, readings=self.collector.readings,
                             registry=registry, insecure=insecure)
        self.watch()

    @classmethod
    def of_fleet(cls, fleet: Fleet, spec: LaunchSpec, ssh, **kw) -> FleetSession:
        """Every host of `fleet` over ssh (one shared connection each)."""
        from console.fleet.remote import SshHost

        return cls([SshHost(h, ssh) for h in fleet.hosts], spec, fleet=fleet, **kw)

    @classmethod
    def this_host(cls, spec: LaunchSpec, **kw) -> FleetSession:
        """The one-host console's fleet: this host."""
        from console.fleet.local import LocalHost

        return cls([LocalHost()], spec, **kw)

    @property
    def alone(self) -> bool:
        """A fleet of one host (the one-host console)."""
        return len(self.hosts) == 1

    @property
    def spec(self) -> LaunchSpec:
        """The launch over the hosts not left out."""
        return self.fleet.service(self.base, self.left_out) if self.fleet is not None else self.base

    def active(self) -> list[str]:
        """The hosts a launch covers, in node order."""
        return [n for n in self.hosts if n not in self.left_out]

    def local_ranks(self) -> int | None:
        """The service's ranks on each host (None: one host holds them all)."""
        return None if self.alone else max(1, self.spec.ranks // max(1, len(self.active())))

    def watch(self) -> None:
        """(Re)tell every host the launch it is planned for: its plan sizes its own ranks' KV."""
        spec, local = self.spec, self.local_ranks()
        self.runner.spec = spec
        self.collector.left_out = tuple(sorted(self.left_out))
        for h in self.hosts.values():
            h.watch(spec, local)

    def leave_out(self, name: str) -> None:
        if name in self.left_out or name not in self.hosts:
            return
        if len(self.active()) <= 1:
            raise ValueError("every other host is left out already: a service needs one host")
        self.left_out |= {name}
        self.watch()
        self.log.add(T.TimelineEvent(kind=T.LEFT_OUT, host=name))

    def bring_back(self, name: str) -> None:
        if name not in self.left_out:
            return
        self.left_out -= {name}
        self.watch()
        self.log.add(T.TimelineEvent(kind=T.BROUGHT_BACK, host=name))

    def launch_problem(self) -> str:
        """Why a launch over the active hosts cannot start now ("" when it can), in words."""
        spec, active = self.spec, self.active()
        if not spec.model and not self.alone:
            return "the fleet's launch needs a model ([launch] model, or --model): the path on every host"
        readings = {r.host: r for r in self.collector.readings()}
        away = [n for n in active if not readings[n].reachable]
        if away:  # its ranks would wait out the rendezvous for a node that never comes
            them = "it" if len(away) == 1 else "them"
            return (f"{', '.join(away)} cannot be reached ({readings[away[0]].error}); leave {them} out (-) to "
                    f"launch on the others")
        if self.fleet is not None and (split := self.fleet.split(spec, len(active))):
            return split
        for n in active:
            snap = readings[n].snapshot
            if snap is not None and (problem := snap.blocking()) is not None:
                return f"{n}: {problem.line()}"
        return ""

    def close(self) -> None:
        self.collector.close()
