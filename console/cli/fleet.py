"""`dsv4 fleet`: the fleet console's code without the TUI — every host's status, the actions
(warm, prepack, compile, purge, pull, import, launch, stop) run on the hosts as the fleet screen
runs them (`console.fleet.runner`: node 0 first, its port relayed; the stop node 0 first; an
import from the host holding the entries), a host's logs over its own connection, and the
events the hosts tell. Hosts and ssh as `dsv4-console --hosts/--fleet` takes them; `--json`
where it lists. Torch-free: the hosts' `dsv4` does the work."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from console.cli.output import confirm
from console.fleet.flags import add_fleet_flags
from runtime.launch.spec import CONSOLE, add_flags
from store.errors import UserError

FIRST_ANSWER_S = 60.0  # every host's first snapshot (ssh, then dsv4 starting there)
ACTS = ("warm", "prepack", "compile", "pull", "import", "launch", "stop")


def register(sub: argparse._SubParsersAction) -> None:
    from console.fleet.actions import WHAT

    common = argparse.ArgumentParser(add_help=False)
    add_flags(common, CONSOLE, model_help="checkpoint dir: its path on every host")
    add_fleet_flags(common)
    group = sub.add_parser("fleet", help="every host of a service: status, actions, logs, events (the fleet console "
                           "without the TUI)",
                           description="The hosts of a service (--hosts or --fleet FILE), reached with the system "
                           "ssh: their status, the fleet console's actions run on them, a host's logs, what happened. "
                           "The launch flags are `dsv4 serve`'s, as dsv4-console takes them.")
    actions = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser("status", parents=[common], help="every host once: reachable, service, plan, KV")
    status.add_argument("--json", action="store_true", help="print every host's snapshot as one JSON object")
    status.set_defaults(func=cmd_status)
    for name in (*ACTS, "purge"):
        p = actions.add_parser(name, parents=[common], help=WHAT[name])
        p.add_argument("targets", nargs="*", metavar="HOST",
                       help="the hosts to run it on (default: every host not left out)" if name != "launch" else
                       "not taken: a launch covers every host not left out (--exclude leaves one out)")
        p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        p.add_argument("--json", action="store_true", help="print each host's outcome as JSON")
        if name == "purge":
            p.add_argument("--scope", choices=("plan", "cache"), default="plan",
                           help="plan: what each host's plan calls stale or corrupt (default); cache: every entry "
                           "that can never be used again")
        p.set_defaults(func=cmd_action)
    logs = actions.add_parser("logs", parents=[common], help="a host's service log, or a rank's (over its connection)")
    logs.add_argument("host", metavar="HOST", help="the host (its name in the fleet)")
    logs.add_argument("--rank", type=int, metavar="N", help="the service's rank N (on whichever host it runs)")
    logs.add_argument("--pid", type=int, metavar="PID", help="which service of that host (default: the newest running)")
    logs.add_argument("--previous", action="store_true", help="the previous run's log of the same (kept beside it)")
    logs.add_argument("--follow", action="store_true", help="keep printing lines as they are written (ctrl+c ends)")
    logs.set_defaults(func=cmd_logs)
    events = actions.add_parser("events", parents=[common], help="what happened on every host, merged by time: "
                                "services registering, serving, failed, stopped, relaunched; hosts stale, "
                                "unreachable and back; actions started and ended (each host's timeline, read over "
                                "its connection)")
    events.add_argument("--json", action="store_true", help="one JSON object per event (repeats not folded)")
    events.set_defaults(func=cmd_events)


def _session(args: argparse.Namespace):
    from console.fleet.flags import session_from

    return session_from(args, required=True)


def cmd_status(args: argparse.Namespace) -> int:
    from console.fleet.rows import kv_total, rows
    from console.tui.once import fleet_text

    session = _session(args)
    try:
        snap = session.collector.once(FIRST_ANSWER_S)
    finally:
        session.close()
    if args.json:
        json.dump(snap.to_json(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(fleet_text(snap, session.spec, kv_total(rows(snap))))
    return 0 if all(r.reachable and r.snapshot is not None for r in snap.hosts) else 1


def _targets(session, args: argparse.Namespace) -> list[str]:
    if args.action == "launch" or not args.targets:
        return session.active()
    if unknown := [t for t in args.targets if t not in session.hosts]:
        raise UserError(f"{unknown[0]}: not a host of this fleet ({', '.join(session.hosts)})")
    return [n for n in session.hosts if n in args.targets]  # in node order


def cmd_action(args: argparse.Namespace) -> int:
    session = _session(args)
    session.log.listeners.append(lambda e: print(e.sentence(), file=sys.stderr if args.json else sys.stdout,
                                                 flush=True))
    try:
        session.collector.first(FIRST_ANSWER_S)
        return asyncio.run(_act(session, args))
    finally:
        session.close()


async def _act(session, args: argparse.Namespace) -> int:
    from console.fleet import actions as A

    action, hosts = args.action, _targets(session, args)
    if action == "pull" and not session.registry:
        raise UserError("pull: no registry; give --registry HOST/REPO or `registry = \"HOST/REPO\"` in the fleet file")
    if action == "launch" and (problem := session.launch_problem()):
        raise UserError(f"launch: {problem}")
    chosen = None
    if action == "purge":
        listed = await session.runner.listing(hosts, args.scope)
        for host, targets in listed.items():
            print(f"{host}: {len(targets)} to delete" + "".join(f"\n  {t.kind} {t.path}: {t.reason}" for t in targets))
        chosen = {h: [t.path for t in ts] for h, ts in listed.items() if ts}
        if not chosen:
            print("nothing to purge on any host")
            return 0
        hosts = list(chosen)
    confirm(args.yes, f"{action} on {', '.join(hosts)}? ({A.WHAT[action]})", refused="cancelled: nothing run")
    jobs = await session.runner.run(action, hosts, chosen=chosen, scope=getattr(args, "scope", A.PLAN_SCOPE))
    if args.json:
        print(json.dumps({h: _job(j) for h, j in jobs.items()}, indent=2))
    return 0 if all(j.ok for j in jobs.values()) else 1


def _job(job) -> dict[str, Any]:
    return {"action": job.action, "ok": job.ok, "outcome": job.outcome, "seconds": job.took,
            "records": job.records}


def cmd_logs(args: argparse.Namespace) -> int:
    from console.fleet.logs import feeds

    session = _session(args)
    try:
        if args.host not in session.hosts:
            raise UserError(f"{args.host}: not a host of this fleet ({', '.join(session.hosts)})")
        snap = session.collector.first(FIRST_ANSWER_S)
        chosen = feeds(session.hosts, snap, args.host, pid=args.pid, rank=args.rank, follow=args.follow)
        if args.previous:
            chosen = [chosen[0].earlier()]
        return asyncio.run(_follow(chosen, args.follow and not args.previous))
    finally:
        session.close()


async def _follow(chosen, follow: bool) -> int:
    feed = chosen[0]
    feed.start()
    print(f"{feed.label} on {feed.host_name}", file=sys.stderr)
    try:
        while True:
            await asyncio.sleep(0.25)
            for line in feed.poll():
                print(line, flush=True)
            if feed.error:
                raise UserError(feed.error)
            if not follow and not feed.running:
                for line in feed.poll():
                    print(line)
                return 0
    finally:
        feed.close()


def cmd_events(args: argparse.Namespace) -> int:
    """Every host's timeline, read over its connection, and this host's (the consoles' actions and
    what they saw of the hosts), merged by time; repeats folded in the text."""
    from console.fleet.events import gather, lines

    session = _session(args)
    try:
        events, problems = asyncio.run(gather(session.hosts))
    finally:
        session.close()
    for host, why in problems.items():
        print(f"{host}: its timeline could not be read: {why}", file=sys.stderr)
    if args.json:
        for event in events:
            print(json.dumps(event.to_json()))
    else:
        print("\n".join(lines(events)) if events else "nothing happened yet (no host's timeline has an event)")
    return 1 if problems else 0
